"""Do the tests catch broken maths? Apply small named mutations to a copy of the project, run the tests that should
catch each, and report the survivors (mutations no test noticed).

    python tools/dev/mutation_check.py                 # every mutation (minutes: each runs its tests)
    python tools/dev/mutation_check.py --only dmd2_swap_real_fake nft_negate_advantages
    python tools/dev/mutation_check.py --list
    python tools/dev/mutation_check.py --check_tests   # every mutation's tests exist (pytest collects them); no run

Each mutation replaces one exact, unique piece of source text (a sign, a swapped pair of roles, a dropped
`.detach()`, an off-by-one index) in a fresh copy of the tracked files, then runs its tests there with pytest
(`-x`, the copy first on the import path). A mutation is *caught* when pytest fails; one whose text is no longer
found (or not unique), or whose tests pytest no longer collects, is reported as stale, so the list cannot rot
silently. Exit code 1 when any mutation survives or is stale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    original: str
    mutated: str
    tests: tuple[str, ...]
    why: str


MUTATIONS = [
    Mutation("euler_step_sign", "predictor_training/rollout/scheduler.py",
             "(sigmas[step_index + 1] - sigmas[step_index])", "(sigmas[step_index] - sigmas[step_index + 1])",
             ("tests/rollout/test_scheduler.py",), "the Euler step walks the wrong way along the flow"),
    Mutation("predictor_loss_hidden_sign", "predictor_training/predictor/loss.py",
             "+ hidden_weight * hidden_mse", "- hidden_weight * hidden_mse",
             ("tests/predictor/test_loss.py::test_predictor_loss_matches_weighted_fp32_mse",),
             "the hidden term of the Predictor's loss is rewarded instead of penalised"),
    Mutation("validation_leaks_rng", "predictor_training/eval/validation.py",
             "            with restored_random_state():\n                for row in self.mine:\n"
             "                    entry = self._reference(row)",
             "            if True:\n                torch.randn(1)\n                for row in self.mine:\n"
             "                    entry = self._reference(row)",
             ("tests/eval/test_validation.py::test_validation_leaves_every_random_state_as_it_found_it",),
             "the Predictor's validation consumes the training's random stream"),
    Mutation("clip_validation_leaks_rng", "predictor_training/eval/validation.py",
             "            with restored_random_state():\n                for row in self.mine:\n"
             "                    entry = self._inputs(row)",
             "            if True:\n                torch.randn(1)\n                for row in self.mine:\n"
             "                    entry = self._inputs(row)",
             ("tests/recipes/test_method_validation.py::test_kd_validation_leaves_training_unchanged",),
             "a method's clip validation consumes the training's random stream"),
    Mutation('kd_student_memory_points_from_the_step_stream', 'fvtools/train_kd.py',
             'memory_seed=item["seed"], text_grad',
             'memory_seed=stream_generator(*counters, 1).initial_seed(), text_grad',
             ('tests/recipes/test_kd_memory_points.py::test_kd_student_context_is_the_cache_rollouts_and_the_teacher_is_its_own_fixed_point',),
             'kd student memory points from the step stream'),
    Mutation('df_sft_teacher_samples_memory_points_from_the_step_stream', 'fvtools/train_df_sft.py',
             '            return int(item["seed"])',
             '            return stream_seed(*counters, 1)',
             ('tests/recipes/test_kd_memory_points.py::test_df_sft_on_teacher_samples_conditions_on_the_samples_own_context', 'tests/recipes/test_kd_memory_points.py::test_clean_context_is_the_history_at_the_context_timestep'),
             'df sft teacher samples memory points from the step stream'),
    Mutation('df_sft_teacher_samples_ignore_the_datasets_memory_settings', 'fvtools/train_df_sft.py',
             '    if args.data == "teacher_samples":\n        return RolloutConfig.from_dataset_config(',
             '    if False:\n        return RolloutConfig.from_dataset_config(',
             ('tests/recipes/test_kd_memory_points.py::test_df_sft_teacher_samples_take_the_datasets_memory_settings',),
             'df sft teacher samples ignore the datasets memory settings'),
    Mutation('noisy_context_prefilled_at_the_clean_context_timestep', 'predictor_training/rollout/teacher_forcing.py',
             'timestep = (1000.0 * self.noisy_context.sigma[index])',
             'timestep = (14.0 + 0 * self.noisy_context.sigma[index])',
             ('tests/recipes/test_kd_memory_points.py::test_independent_context_noise_is_diffusion_forcing',),
             'noisy context prefilled at the clean context timestep'),
    Mutation('noisy_context_reads_the_clean_history', 'predictor_training/rollout/teacher_forcing.py',
             'noisy = self.noisy_context.latents[:, :, index]',
             'noisy = rollout.latents[:, :, index]',
             ('tests/recipes/test_kd_memory_points.py::test_independent_context_noise_is_diffusion_forcing',),
             'noisy context reads the clean history'),
    Mutation('noisy_context_one_level_for_every_chunk', 'fvtools/train_df_sft.py',
             'sigma = chunk_sigmas(levels[None], chunk_latents)',
             'sigma = chunk_sigmas(levels[:1].expand_as(levels)[None], chunk_latents)',
             ('tests/recipes/test_kd_memory_points.py::test_independent_context_noise_is_diffusion_forcing',),
             'noisy context one level for every chunk'),
    Mutation('noisy_context_drawn_from_the_targets_stream', 'fvtools/train_df_sft.py',
             'generator = stream_generator(*counters, 2)',
             'generator = stream_generator(*counters)',
             ('tests/recipes/test_kd_memory_points.py::test_independent_context_noise_is_diffusion_forcing',),
             'noisy context drawn from the targets stream'),
    Mutation('velocity_target_sign_flipped', 'predictor_training/methods/flow_matching.py',
             'return noise.float() - x0.float()',
             'return x0.float() - noise.float()',
             ('tests/methods/test_flow_matching.py::test_an_euler_step_of_the_exact_velocity_lands_on_the_next_noise_level', 'tests/methods/test_flow_matching.py::test_the_teachers_ar_loop_fed_the_exact_velocity_reproduces_the_data'),
             'velocity target sign flipped'),
    Mutation('add_noise_swaps_x0_and_noise', 'predictor_training/methods/flow_matching.py',
             'return (1 - s) * x0.float() + s * noise.float()',
             'return (1 - s) * noise.float() + s * x0.float()',
             ('tests/methods/test_flow_matching.py::test_an_euler_step_of_the_exact_velocity_lands_on_the_next_noise_level', 'tests/methods/test_flow_matching.py::test_the_teachers_ar_loop_fed_the_exact_velocity_reproduces_the_data'),
             'add noise swaps x0 and noise'),
    Mutation('x0_from_velocity_sign_flipped', 'predictor_training/methods/flow_matching.py',
             'return x_sigma.float() - sigma.to(torch.float32)[:, None, :, None, None] * velocity.float()',
             'return x_sigma.float() + sigma.to(torch.float32)[:, None, :, None, None] * velocity.float()',
             ('tests/methods/test_flow_matching.py::test_an_euler_step_of_the_exact_velocity_lands_on_the_next_noise_level', 'tests/recipes/test_kd_memory_points.py::test_kd_student_context_is_the_cache_rollouts_and_the_teacher_is_its_own_fixed_point'),
             'x0 from velocity sign flipped'),
    Mutation('kd_student_state_indices_off_by_one', 'fvtools/train_kd.py',
             'indices.append(matches[0])',
             'indices.append(matches[0] + 1)',
             ('tests/recipes/test_kd_memory_points.py::test_student_state_indices_table',),
             'kd student state indices off by one'),
    Mutation('kd_step_state_index_off_by_one', 'fvtools/train_kd.py',
             'state = self.state_indices[level]',
             'state = self.state_indices[level] + 1',
             ('tests/recipes/test_kd_memory_points.py::test_kd_feeds_each_state_at_its_own_level_on_the_students_grid',),
             'kd step state index off by one'),
    Mutation('kd_step_sigma_of_the_previous_state', 'fvtools/train_kd.py',
             'sigma = float(item["sigmas"][state])',
             'sigma = float(item["sigmas"][max(state - 1, 0)])',
             ('tests/recipes/test_kd_memory_points.py::test_kd_feeds_each_state_at_its_own_level_on_the_students_grid',),
             'kd step sigma of the previous state'),
    Mutation('dmd2_recipe_swap_real_fake_args', 'fvtools/train_dmd2.py',
             'gradient = dmd_gradient(x0_fake, x0_real, detached)',
             'gradient = dmd_gradient(x0_real, x0_fake, detached)',
             ('tests/recipes/test_train_dmd2.py::test_the_generator_sample_gets_the_dmd_gradient_of_fake_minus_real[F-P-P-P]', 'tests/recipes/test_train_dmd2.py::test_the_generator_sample_gets_the_dmd_gradient_of_fake_minus_real[F-P-P-F]'),
             'dmd2 recipe swap real fake args'),
    Mutation('dmd2_recipe_real_x0_from_fake_score', 'fvtools/train_dmd2.py',
             'x0_real = real_clip.x0(chunk_index, score_input, score_sigma)',
             'x0_real = fake_clip.x0(chunk_index, score_input, score_sigma)',
             ('tests/recipes/test_train_dmd2.py::test_the_generator_sample_gets_the_dmd_gradient_of_fake_minus_real[F-P-P-P]',),
             'dmd2 recipe real x0 from fake score'),
    Mutation('dmd2_recipe_scores_on_other_inputs', 'fvtools/train_dmd2.py',
             'x0_fake = fake_clip.x0(chunk_index, score_input, score_sigma)',
             'x0_fake = fake_clip.x0(chunk_index, critic_input, critic_sigma)',
             ('tests/recipes/test_train_dmd2.py::test_the_generator_sample_gets_the_dmd_gradient_of_fake_minus_real[F-P-P-P]',),
             'dmd2 recipe scores on other inputs'),
    Mutation('dmd_gradient_sign', 'predictor_training/methods/dmd2.py',
             'torch.nan_to_num((x0_fake - x0_real) / scale',
             'torch.nan_to_num((x0_real - x0_fake) / scale',
             ('tests/methods/test_dmd2.py::test_a_dmd_step_moves_the_sample_towards_the_real_score_and_away_from_the_fake', 'tests/methods/test_dmd2.py::test_exact_scores_converge_to_the_data_distribution', 'tests/recipes/test_train_dmd2.py::test_the_generator_sample_gets_the_dmd_gradient_of_fake_minus_real[F-P-P-P]'),
             'dmd gradient sign'),
    Mutation('dmd_gradient_normaliser_on_fake', 'predictor_training/methods/dmd2.py',
             'scale = (sample - x0_real).abs().mean(dim=axes, keepdim=True)',
             'scale = (sample - x0_fake).abs().mean(dim=axes, keepdim=True)',
             ('tests/methods/test_dmd2.py::test_a_dmd_step_moves_the_sample_towards_the_real_score_and_away_from_the_fake', 'tests/recipes/test_train_dmd2.py::test_the_generator_sample_gets_the_dmd_gradient_of_fake_minus_real[F-P-P-P]'),
             'dmd gradient normaliser on fake'),
    Mutation('dmd_generator_loss_sign', 'predictor_training/methods/dmd2.py',
             'target = (sample - gradient.float()).detach()',
             'target = (sample + gradient.float()).detach()',
             ('tests/methods/test_dmd2.py::test_a_dmd_step_moves_the_sample_towards_the_real_score_and_away_from_the_fake', 'tests/methods/test_dmd2.py::test_generator_loss_gradient_is_the_dmd_gradient', 'tests/recipes/test_train_dmd2.py::test_the_generator_sample_gets_the_dmd_gradient_of_fake_minus_real[F-P-P-P]'),
             'dmd generator loss sign'),
    Mutation('dmd_generator_loss_dropped_detach', 'predictor_training/methods/dmd2.py',
             'target = (sample - gradient.float()).detach()',
             'target = (sample - gradient.float())',
             ('tests/methods/test_dmd2.py::test_a_dmd_step_moves_the_sample_towards_the_real_score_and_away_from_the_fake', 'tests/methods/test_dmd2.py::test_generator_loss_gradient_is_the_dmd_gradient'),
             'dmd generator loss dropped detach'),
    Mutation('critic_target_x0_minus_noise', 'predictor_training/methods/dmd2.py',
             'velocity_target(sample.detach().float(), noise.float())',
             'velocity_target(noise.float(), sample.detach().float())',
             ('tests/methods/test_dmd2.py::test_the_critic_target_is_noise_minus_x0', 'tests/recipes/test_train_dmd2.py::test_the_critic_regresses_the_fake_score_onto_noise_minus_sample'),
             'critic target x0 minus noise'),
    Mutation('flow_matching_velocity_sign', 'predictor_training/methods/flow_matching.py',
             'return noise.float() - x0.float()',
             'return x0.float() - noise.float()',
             ('tests/methods/test_flow_matching.py::test_flow_matching_velocity_is_the_teachers_euler_velocity', 'tests/methods/test_dmd2.py::test_the_critic_target_is_noise_minus_x0'),
             'flow matching velocity sign'),
    Mutation('dmd2_recipe_critic_args_swapped', 'fvtools/train_dmd2.py',
             'loss_critic = critic_loss(velocity, critic_noise, detached)',
             'loss_critic = critic_loss(velocity, detached, critic_noise)',
             ('tests/recipes/test_train_dmd2.py::test_the_critic_regresses_the_fake_score_onto_noise_minus_sample',),
             'dmd2 recipe critic args swapped'),
    Mutation('dmd2_recipe_critic_on_real_score', 'fvtools/train_dmd2.py',
             'velocity = fake_clip.velocity(chunk_index, critic_input, critic_sigma)',
             'velocity = real_clip.velocity(chunk_index, critic_input, critic_sigma)',
             ('tests/recipes/test_train_dmd2.py::test_the_critic_regresses_the_fake_score_onto_noise_minus_sample', 'tests/recipes/test_train_dmd2.py::test_a_step_without_the_generator_trains_only_the_critic'),
             'dmd2 recipe critic on real score'),
    Mutation('dmd2_recipe_critic_on_the_score_draw', 'fvtools/train_dmd2.py',
             'velocity = fake_clip.velocity(chunk_index, critic_input, critic_sigma)',
             'velocity = fake_clip.velocity(chunk_index, score_input, score_sigma)',
             ('tests/recipes/test_train_dmd2.py::test_the_critic_regresses_the_fake_score_onto_noise_minus_sample',),
             "the critic's fake-score velocity at the scores' noisy input, not its own"),
    Mutation('dmd2_recipe_critic_sample_not_detached', 'fvtools/train_dmd2.py',
             'detached = chunk.sample.detach().float()',
             'detached = chunk.sample.float()',
             ('tests/recipes/test_train_dmd2.py::test_the_generator_sample_gets_the_dmd_gradient_of_fake_minus_real[F-P-P-P]',),
             'dmd2 recipe critic sample not detached'),
    Mutation('real_lora_score_trainable', 'predictor_training/methods/dmd2_models.py',
             'load_lora(teacher, settings.real_score_path, REAL, trainable=False)',
             'load_lora(teacher, settings.real_score_path, REAL, trainable=True)',
             ('tests/recipes/test_train_dmd2.py::test_roles_real_frozen_fake_every_step_generator_at_its_cadence',),
             'real lora score trainable'),
    Mutation('real_model_score_trainable', 'predictor_training/methods/dmd2_models.py',
             'real = ScoreModel(model, None, REAL)',
             'real = ScoreModel(model.requires_grad_(True), None, REAL)',
             ('tests/recipes/test_train_dmd2.py::test_roles_real_frozen_fake_every_step_generator_at_its_cadence',),
             'real model score trainable'),
    Mutation('fake_score_at_generator_cadence', 'predictor_training/methods/dmd2_models.py',
             'grad_clip=settings.fake_score_grad_clip, grad_sync="all_reduce")',
             'grad_clip=settings.fake_score_grad_clip, grad_sync="all_reduce", every=3)',  # the test's --generator_every
             ('tests/recipes/test_train_dmd2.py::test_roles_real_frozen_fake_every_step_generator_at_its_cadence',),
             'fake score at generator cadence'),
    Mutation('predictor_generator_every_step', 'predictor_training/methods/dmd2_models.py',
             'module=module, every=every, grad_clip=settings.grad_clip,',
             'module=module, every=1, grad_clip=settings.grad_clip,',
             ('tests/recipes/test_train_dmd2.py::test_roles_real_frozen_fake_every_step_generator_at_its_cadence',),
             'predictor generator every step'),
    Mutation('dmd2_recipe_generator_always_due', 'fvtools/train_dmd2.py',
             'generator_due = self.generator_role.name in due',
             'generator_due = True',
             ('tests/recipes/test_train_dmd2.py::test_the_generator_loss_is_applied_only_when_due', 'tests/recipes/test_train_dmd2.py::test_a_step_without_the_generator_trains_only_the_critic'),
             'dmd2 recipe generator always due'),
    Mutation('dmd2_recipe_generator_loss_when_not_due', 'fvtools/train_dmd2.py',
             '            if generator_due:\n                with torch.no_grad():',
             '            if True:\n                with torch.no_grad():',
             ('tests/recipes/test_train_dmd2.py::test_the_generator_loss_is_applied_only_when_due',),
             'dmd2 recipe generator loss when not due'),
    Mutation('dmd2_recipe_critic_on_the_unmade_chunk', 'fvtools/train_dmd2.py',
             'detached = chunk.sample.detach().float()',
             'detached = rollout.history[:, :, 4 * chunk_index:4 * chunk_index + 4].float()',
             ('tests/recipes/test_train_dmd2.py::test_critic_and_generator_use_the_one_rollout',),
             'the scores see the chunk slot of the history (its noise), not the generator sample'),
    Mutation('dmd2_recipe_dmd_loss_on_the_detached_sample', 'fvtools/train_dmd2.py',
             'loss_dmd = dmd_generator_loss(chunk.sample, gradient)',
             'loss_dmd = dmd_generator_loss(chunk.sample.detach(), gradient)',
             ('tests/recipes/test_train_dmd2.py::test_dmd_reaches_the_predictor_when_the_chunk_ends_on_a_full_step',),
             'the DMD loss never reaches the generator'),
    Mutation('dmd2_recipe_student_ignores_the_recompute_flag', 'fvtools/train_dmd2.py',
             'recompute_context=args.recompute_context, teacher_clip=teacher_clip)',
             'recompute_context=True, teacher_clip=teacher_clip)',
             ('tests/tools/test_estimate_memory_dmd2.py::test_the_student_context_recompute_changes_no_value',),
             '--no-recompute_context does not reach the student generator'),
    Mutation('composite_context_never_released', 'predictor_training/methods/chunk_generators.py',
             '        if self.recompute_context:\n            graph.release_context()',
             '        if self.recompute_context:\n            pass',
             ('tests/tools/test_estimate_memory_dmd2.py::test_the_generator_context_cut_lowers_the_peak',),
             "the Predictor generator's context K/V of every layer held through the critic"),
    Mutation('dmd2_recipe_composite_ignores_the_recompute_flag', 'fvtools/train_dmd2.py',
             'data if args.rollout == "data" else None,\n                                    '
             'recompute_context=args.recompute_context)',
             'data if args.rollout == "data" else None,\n                                    recompute_context=True)',
             ('tests/tools/test_estimate_memory_dmd2.py::test_the_generator_context_cut_changes_no_value[F-P-P-F]',),
             '--no-recompute_context does not reach the Predictor generator'),
    Mutation('after_commit_runs_before_the_commit', 'predictor_training/rollout/ar_rollout.py',
             '            self.commit_chunk(run)\n            policy.after_commit(run)',
             '            policy.after_commit(run)\n            self.commit_chunk(run)',
             ('tests/rollout/test_ar_rollout.py::test_after_commit_sees_the_committed_chunk_and_its_writes_are_the_next_contexts',
              'tests/methods/test_chunk_generators.py::test_teacher_chunks_are_the_teachers_rollout_of_the_noise[data]'),
             "after_commit runs before the commit (teacher forcing's data overwritten by the chunk)"),
    Mutation('fppf_sample_without_graph', 'predictor_training/methods/chunk_generators.py',
             'if not trailing or not torch.is_grad_enabled():',
             'if True:',
             ('tests/recipes/test_train_dmd2.py::test_dmd_reaches_the_predictor_when_the_chunk_ends_on_a_full_step', 'tests/methods/test_chunk_generators.py::test_the_composite_sample_is_its_final_latent_with_the_predictor_graph[F-P-P-F]'),
             'fppf sample without graph'),
    Mutation('fppf_recompute_from_detached_predictor_velocity', 'predictor_training/methods/chunk_generators.py',
             'latent = differentiable_euler_step(last.latent, last.pred_velocity, rollout.sigmas, last.step_index)',
             'latent = differentiable_euler_step(last.latent.detach(), last.pred_velocity.detach(), rollout.sigmas, last.step_index)',
             ('tests/recipes/test_train_dmd2.py::test_dmd_reaches_the_predictor_when_the_chunk_ends_on_a_full_step', 'tests/methods/test_chunk_generators.py::test_the_composite_sample_is_its_final_latent_with_the_predictor_graph[F-P-P-F]'),
             'fppf recompute from detached predictor velocity'),
    Mutation('fppf_recompute_starts_one_step_late', 'predictor_training/methods/chunk_generators.py',
             'latent=latent, first_step=trailing[0])',
             'latent=latent, first_step=trailing[0] + 1)',
             ('tests/methods/test_chunk_generators.py::test_the_composite_sample_is_its_final_latent_with_the_predictor_graph[F-P-P-F]',),
             'the F-P-P-F recompute skips the trailing Full step'),
    Mutation('chunk_loop_ignores_where_the_graph_stops', 'predictor_training/rollout/ar_rollout.py',
             'stepped = differentiable_euler_step(latent.detach() if output.graph_stops else latent, output.velocity,',
             'stepped = differentiable_euler_step(latent, output.velocity,',
             ('tests/predictor/test_self_rollout.py::test_fppf_runs_the_teacher_at_step_3_where_gradients_stop',),
             "a trainer's Full step (a Teacher label) lets gradients through to the steps before it"),
    Mutation('training_label_keeps_the_student_graph', 'predictor_training/rollout/ar_rollout.py',
             '        label_input = call.model_input.detach()',
             '        label_input = call.model_input',
             ('tests/predictor/test_self_rollout.py::test_04_teacher_target_input_is_the_detached_student_latent',),
             "the Teacher's label is computed on the student latent with its graph (not a stop-gradient target)"),
    Mutation('training_full_step_keeps_the_graph', 'predictor_training/rollout/ar_rollout.py',
             '            return dataclasses.replace(label, graph_stops=True)',
             '            return label',
             ('tests/predictor/test_self_rollout.py::test_fppf_runs_the_teacher_at_step_3_where_gradients_stop',),
             "a trained chunk's Full step k >= 1 lets gradients through to the steps before it"),
    Mutation('previous_chunk_hidden_handed_on_with_its_graph', 'predictor_training/predictor/self_rollout.py',
             'self.prev_chunk_hidden = {k: hidden.detach() for k, hidden in graph.pred_hidden_by_step().items()}',
             'self.prev_chunk_hidden = {k: hidden for k, hidden in graph.pred_hidden_by_step().items()}',
             ('tests/predictor/test_self_rollout.py::test_08_chunk2_loss_does_not_reach_chunk1_final_latent_or_hidden',),
             "a later chunk's loss reaches this chunk through its predicted hiddens"),
    Mutation('ema_direction_swapped', 'predictor_training/runtime/roles.py',
             'self.shadow[name].mul_(decay).add_(param.detach().float(), alpha=1.0 - decay)',
             'self.shadow[name].mul_(1.0 - decay).add_(param.detach().float(), alpha=decay)',
             ('tests/runtime/test_roles.py::test_the_generator_ema_direction_and_start',),
             'ema direction swapped'),
    Mutation('dmd2_ema_start_in_loop_steps', 'predictor_training/methods/dmd2_models.py',
             'start_update=start_step // every',
             'start_update=start_step',
             ('tests/methods/test_dmd2_models.py::test_the_dmd2_generator_ema_comes_from_its_flags', 'tests/recipes/test_train_dmd2.py::test_roles_real_frozen_fake_every_step_generator_at_its_cadence'),
             'dmd2 ema start in loop steps'),
    Mutation('dmd2_ema_export_raw_weights', 'predictor_training/runtime/roles.py',
             'state.update(self.shadow)',
             'state.update({})',
             ('tests/runtime/test_roles.py::test_roles_step_at_their_cadence_with_their_own_schedule_and_ema',
              'tests/recipes/test_train_dmd2.py::test_the_generator_ema_is_exported_next_to_the_raw_weights'),
             'the EMA export writes the raw weights'),
    Mutation('nft_advantage_negated_in_step', 'fvtools/train_nft.py',
             'advantages[index:index + 1].to(device)',
             '(-advantages[index:index + 1]).to(device)',
             ('tests/recipes/test_train_nft.py::test_step_trains_each_sample_with_its_own_advantage_on_the_sampler_grid',),
             'nft advantage negated in step'),
    Mutation('nft_advantage_sign_in_group_advantages', 'predictor_training/methods/nft.py',
             'return (rewards - mean) / (scale + eps)',
             'return (mean - rewards) / (scale + eps)',
             ('tests/methods/test_nft.py::test_advantage_sign_and_global_std', 'tests/methods/test_nft.py::test_mean_reward_rises', 'tests/recipes/test_train_nft.py::test_step_trains_each_sample_with_its_own_advantage_on_the_sampler_grid'),
             'nft advantage sign in group advantages'),
    Mutation('nft_global_std_is_group_std', 'predictor_training/methods/nft.py',
             'scale = rewards.std(unbiased=False)',
             'scale = rewards.std(dim=1, keepdim=True, unbiased=False)',
             ('tests/methods/test_nft.py::test_advantage_sign_and_global_std',),
             'nft global std is group std'),
    Mutation('nft_loss_positive_negative_swapped', 'predictor_training/methods/nft.py',
             'r * weighted(x0_positive) + (1 - r) * weighted(x0_negative)',
             '(1 - r) * weighted(x0_positive) + r * weighted(x0_negative)',
             ('tests/methods/test_nft.py::test_nft_positive_advantage_pulls_the_policy_towards_the_sample', 'tests/methods/test_nft.py::test_mean_reward_rises'),
             'nft loss positive negative swapped'),
    Mutation('nft_kl_sign', 'predictor_training/methods/nft.py',
             'return nft + kl_weight * kl, nft, kl',
             'return nft - kl_weight * kl, nft, kl',
             ('tests/methods/test_nft.py::test_nft_objective_kl_pulls_the_policy_towards_the_reference',),
             'nft kl sign'),
    Mutation('nft_kl_anchored_on_old_policy', 'predictor_training/methods/nft.py',
             'kl = torch.mean((v_policy.float() - v_reference.detach().float()) ** 2)',
             'kl = torch.mean((v_policy.float() - v_old.detach().float()) ** 2)',
             ('tests/methods/test_nft.py::test_nft_objective_kl_pulls_the_policy_towards_the_reference',),
             'nft kl anchored on old policy'),
    Mutation('nft_old_policy_ema_reversed', 'predictor_training/methods/nft.py',
             'mixed = decay * old.float() + (1.0 - decay) * policy[name].detach().float()',
             'mixed = (1.0 - decay) * old.float() + decay * policy[name].detach().float()',
             ('tests/methods/test_nft.py::test_old_policy_ema_moves_the_old_policy_by_one_minus_decay', 'tests/methods/test_nft.py::test_old_policy_follows_its_schedule'),
             'nft old policy ema reversed'),
    Mutation('nft_sigma_grid_off_by_one', 'predictor_training/methods/nft.py',
             'return flow_match_sigmas(num_steps, shift)[:-1]',
             'return flow_match_sigmas(num_steps, shift)[1:]',
             ('tests/methods/test_nft.py::test_training_sigmas_are_the_samplers_grid', 'tests/recipes/test_train_nft.py::test_sigma_and_advantage_flags'),
             'nft sigma grid off by one'),
    Mutation('nft_train_sigmas_default_range', 'fvtools/train_nft.py',
             'choices=TRAIN_SIGMAS, default="sampler_grid"',
             'choices=TRAIN_SIGMAS, default="range"',
             ('tests/recipes/test_train_nft.py::test_sigma_and_advantage_flags', 'tests/recipes/test_train_nft.py::test_step_trains_each_sample_with_its_own_advantage_on_the_sampler_grid'),
             'nft train sigmas default range'),
    Mutation("run_start_destroys_a_joined_group", "predictor_training/runtime/launch.py",
             "        if not joined:\n            cleanup_distributed()", "        if True:\n            cleanup_distributed()",
             ("tests/recipes/test_train_predictor_v4_rollout.py",),
             "a recipe's run start destroys the process group its caller made (the next main in it fails; slow: the "
             "other rank waits out its timeout)"),
    Mutation('nft_sigma_floor_not_enforced', 'predictor_training/methods/nft.py',
             'if distilled and settings.sigma_min < DISTILLED_SIGMA_FLOOR and not allow_sigma_below_teacher:',
             'if distilled and settings.sigma_min < 0 and not allow_sigma_below_teacher:',
             ('tests/recipes/test_train_nft.py::test_sigma_and_advantage_flags',),
             'nft sigma floor not enforced'),
    Mutation('nft_advantage_std_default_group', 'fvtools/train_nft.py',
             'choices=ADVANTAGE_STDS, default="global"',
             'choices=ADVANTAGE_STDS, default="group"',
             ('tests/recipes/test_train_nft.py::test_sigma_and_advantage_flags',),
             'nft advantage std default group'),
    Mutation('adv_generator_loss_sign', 'predictor_training/methods/adversarial.py',
             'return -functional_call(discriminator, frozen, (fake, timestep, context)).mean()',
             'return functional_call(discriminator, frozen, (fake, timestep, context)).mean()',
             ('tests/methods/test_adversarial.py::test_generator_loss_is_minus_mean_critic_and_raises_the_fakes_score',),
             'adv generator loss sign'),
    Mutation('adv_hinge_sign', 'predictor_training/methods/adversarial.py',
             'loss = torch.relu(1 - real_logits).mean() + torch.relu(1 + fake_logits).mean()',
             'loss = torch.relu(1 + real_logits).mean() + torch.relu(1 - fake_logits).mean()',
             ('tests/methods/test_adversarial.py::test_hinge_discriminator_loss_raises_real_and_lowers_fake', 'tests/methods/test_adversarial.py::test_discriminator_separates_real_from_fake'),
             'adv hinge sign'),
    Mutation('adv_r1_on_fake', 'predictor_training/methods/adversarial.py',
             'penalty = r1_penalty(self.discriminator, real, timestep, condition)',
             'penalty = r1_penalty(self.discriminator, fake, timestep, condition)',
             ('tests/methods/test_adversarial.py::test_r1_is_taken_on_the_real_hiddens_only',),
             'adv r1 on fake'),
    Mutation('adv_straight_through_detached', 'predictor_training/methods/adversarial.py',
             'return fake + (rounded - fake.detach())',
             'return rounded',
             ('tests/methods/test_adversarial.py::test_fake_is_rounded_to_the_reals_grid_with_a_straight_through_gradient', 'tests/recipes/test_train_adversarial.py::test_one_step_gives_gradients_only_where_each_loss_may_reach'),
             'adv straight through detached'),
    Mutation('adv_straight_through_plain_cast', 'predictor_training/methods/adversarial.py',
             'return fake + (rounded - fake.detach())',
             'return fake.to(real_dtype).float()',
             ('tests/methods/test_adversarial.py::test_fake_is_rounded_to_the_reals_grid_with_a_straight_through_gradient',),
             'adv straight through plain cast'),
    Mutation('adv_generator_term_unrounded', 'predictor_training/methods/adversarial.py',
             'generator_loss(self.discriminator, on_real_grid(pred_hidden, real_dtype), timestep.float(), condition)',
             'generator_loss(self.discriminator, pred_hidden.float(), timestep.float(), condition)',
             ('tests/methods/test_adversarial.py::test_fake_is_rounded_to_the_reals_grid_with_a_straight_through_gradient', 'tests/recipes/test_train_adversarial.py::test_discriminator_sees_the_fake_on_the_reals_grid'),
             'adv generator term unrounded'),
    Mutation('adv_discriminator_fake_unrounded', 'predictor_training/methods/adversarial.py',
             'fake = on_real_grid(fake.detach(), real.dtype)',
             'fake = fake.detach().float()',
             ('tests/methods/test_adversarial.py::test_fake_is_rounded_to_the_reals_grid_with_a_straight_through_gradient', 'tests/recipes/test_train_adversarial.py::test_discriminator_sees_the_fake_on_the_reals_grid'),
             'adv discriminator fake unrounded'),
    Mutation('adv_offline_real_dtype_wiring', 'fvtools/train_adversarial.py',
             'real_dtype=batch["target_hidden"].dtype)',
             'real_dtype=pred_hidden.dtype)',
             ('tests/recipes/test_train_adversarial.py::test_discriminator_sees_the_fake_on_the_reals_grid',),
             'adv offline real dtype wiring'),
    Mutation('context_recompute_never_releases', 'predictor_training/rollout/teacher_forcing.py',
             '        if recompute:\n            context_kv.release()',
             '        if recompute:\n            pass',
             ('tests/tools/test_estimate_memory_dmd2.py::test_the_student_context_recompute_lowers_the_peak',
              'tests/tools/test_estimate_memory_dmd2.py::test_the_student_context_recompute_changes_no_value'),
             "the student's no-grad context stays held from its forward to the generator's backward"),
    Mutation('context_rebuilt_under_the_base_teacher', 'predictor_training/rollout/ar_rollout.py',
             '            with adapter(self.teacher, name):',
             '            with adapter(self.teacher, None):',
             ('tests/tools/test_estimate_memory_dmd2.py::test_the_student_context_recompute_changes_no_value',),
             "the released context is prefilled again without the student's adapter"),
    Mutation('context_rebuild_outlives_the_backward', 'predictor_training/teacher/cache.py',
             '        if self.rebuilt:\n            self.kv[index] = None',
             '        if self.rebuilt:\n            pass',
             ('tests/teacher/test_cache.py::test_recomputed_context_releases_rebuilds_once_and_hands_layers_over',),
             'the rebuilt context K/V stay alive after the backward that read them'),
    Mutation('recomputed_context_handles_hold_their_owner', 'predictor_training/teacher/cache.py',
             '        super().__init__([_RecomputedLayer(store, index) for index in range(context.num_layers)], '
             'context.num_frames)\n        self._store = store',
             '        super().__init__([_RecomputedLayer(store, index) for index in range(context.num_layers)], '
             'context.num_frames)\n        self._store = store\n        store.owner = self',
             ('tests/teacher/test_cache.py::test_a_dropped_recomputed_context_frees_its_kv_without_the_garbage_collector',),
             'a dropped context keeps its K/V until the next garbage collection (a reference cycle)'),
    Mutation('fsdp_keeps_unsharded_gradients_to_the_last_chunk', 'predictor_training/runtime/fsdp.py',
             '    if is_fsdp(module):\n        return contextlib.nullcontext()',
             '    if is_fsdp(module):\n        module.set_requires_gradient_sync(enabled)\n        return contextlib.nullcontext()',
             ('tests/tools/test_estimate_memory.py::test_fsdp_full_run_holds_the_per_rank_share',),
             "FSDP2 skips the reduce-scatter on accumulation chunks (every block's unsharded FP32 gradient held)"),
    Mutation('fppf_trailing_step_holds_the_context', 'predictor_training/methods/chunk_generators.py',
             '        if recomputed:\n            context.kv.release()',
             '        if recomputed:\n            pass',
             ('tests/tools/test_estimate_memory_dmd2.py::test_the_generator_context_cut_changes_no_value',),
             "the F-P-P-F trailing Full step's checkpoints hold every layer's context through the critic"),
    Mutation('fppf_teacher_blocks_not_checkpointed', 'predictor_training/methods/dmd2_models.py',
             '    teacher.set_gradient_checkpointing(settings.gradient_checkpointing)\n    init_meta = None',
             '    init_meta = None',
             ('tests/tools/test_estimate_memory_dmd2.py::test_the_generator_context_cut_changes_no_value',),
             "the F-P-P-F trailing Full step runs on a Teacher without block checkpoints (its activations all saved)"),
    # the leaderboard (issue 36): the front, the bootstrap, the caches' formulas, the sampler plans
    Mutation("front_mixes_in_db", "predictor_training/eval/front.py",
             "mixed = mse_to_psnr(lam * a.mse + (1.0 - lam) * b.mse)",
             "mixed = lam * a.psnr + (1.0 - lam) * b.psnr",
             ("tests/eval/test_front.py::test_front_mixes_in_mse_and_margins_are_signed",),
             "time-sharing two rows is interpolated in dB (flatters the front's mixtures)"),
    Mutation("front_mixture_share_swapped", "predictor_training/eval/front.py",
             "lam = (b.cost - cost) / (b.cost - a.cost)", "lam = (cost - a.cost) / (b.cost - a.cost)",
             ("tests/eval/test_front.py::test_front_mixes_in_mse_and_margins_are_signed",),
             "the cheaper row gets the dearer row's share of the chunks"),
    Mutation("bootstrap_ignores_the_videos", "predictor_training/eval/front.py",
             "draws[row] = np.bincount(rng.integers(0, videos, videos), minlength=videos)",
             "draws[row] = 1.0",
             ("tests/eval/test_front.py::test_paired_bootstrap_recovers_a_known_mean_difference",),
             "the bootstrap never resamples: every interval has zero width"),
    Mutation("taylor_slope_sign", "predictor_training/eval/caches.py",
             "return (h_b + (sigma - later.sigma) * slope)", "return (h_b - (sigma - later.sigma) * slope)",
             ("tests/eval/test_caches.py::test_taylor_forecast_of_a_linear_trajectory_is_exact",),
             "the TaylorSeer forecast extrapolates backwards"),
    Mutation("taylor_previous_chunk_delta_swapped", "predictor_training/eval/caches.py",
             "delta = previous[call.step_index].final_hidden.float() - previous[anchor.step].final_hidden.float()",
             "delta = previous[anchor.step].final_hidden.float() - previous[call.step_index].final_hidden.float()",
             ("tests/eval/test_caches.py::test_taylor_with_one_full_step_takes_the_slope_of_the_previous_chunk",),
             "the one-Full-step forecast takes the previous chunk's change the wrong way round"),
    Mutation("teacache_never_resets", "predictor_training/eval/caches.py",
             "            self.accumulated = 0.0\n            self.residual = output.final_hidden - embedded",
             "            self.residual = output.final_hidden - embedded",
             ("tests/eval/test_caches.py::test_adaptive_rule_accumulates_until_the_threshold_and_resets_when_it_computes",),
             "TeaCache keeps accumulating after a computed step"),
    Mutation("sampler_plan_drops_a_kept_step", "predictor_training/eval/leaderboard.py",
             '"F" if step == 0 or step in kept else "R"', '"F" if step == 0 else "R"',
             ("tests/eval/test_leaderboard.py::test_samplers_are_every_step_subset_that_keeps_step_zero",),
             "every k-step sampler collapses to the 1-step sampler"),
    Mutation("reuse_step_trains_on_a_teacher_step", "predictor_training/rollout/ar_rollout.py",
             "        if k in self.reuse_steps:", "        if False:",
             ("tests/predictor/test_self_rollout.py::test_frrp_reuses_v0_for_steps_1_2_and_trains_step_3_on_the_eval_plans_latent",),
             "F-R-R-P training runs the Teacher at the reuse steps (another latent than the eval's)"),
    Mutation("adv_r1_on_every_discriminator_update", "predictor_training/methods/adversarial.py",
             "apply_r1 = self.r1_weight > 0 and self.discriminator_role.updates % self.r1_every == 0",
             "apply_r1 = self.r1_weight > 0",
             ("tests/recipes/test_train_adversarial.py::test_lazy_r1_only_on_its_cadence",
              "tests/recipes/test_train_adversarial.py::test_no_r1_pass_off_its_cadence"),
             "lazy R1 on every discriminator update instead of every r1_every-th"),
    Mutation("adv_r1_pass_off_its_cadence", "predictor_training/methods/adversarial.py",
             "        if apply_r1:\n            penalty = r1_penalty(self.discriminator, real, timestep, condition)",
             "        penalty = r1_penalty(self.discriminator, real, timestep, condition)\n        if apply_r1:",
             ("tests/recipes/test_train_adversarial.py::test_no_r1_pass_off_its_cadence",),
             "the R1 pass runs on every discriminator update, applied or not"),
    Mutation("eval_predictor_context_of_other_layers", "predictor_training/eval/methods.py",
             "context = call.context.kv.select(blocks)", "context = call.context.kv.select(blocks[::-1])",
             ("tests/eval/test_methods.py::test_predictor_inputs_come_from_this_rollout",),
             "the eval's Predictor reads the context K/V of the wrong source layers"),
    Mutation("chunk_zero_under_grad", "predictor_training/rollout/ar_rollout.py",
             "        \"\"\"Entered around the chunk's steps and `end_chunk` (grad mode; a trainer's DDP `no_sync`).\"\"\"\n"
             "        return torch.no_grad()",
             "        return contextlib.nullcontext()",
             ("tests/predictor/test_self_rollout.py::test_02_chunk0_is_full_teacher_without_gradients_and_keeps_prev_hidden",),
             "chunk 0's F-F-F-F (and every untrained chunk) builds a graph"),
    Mutation("last_step_mode_runs_the_kv_pass", "predictor_training/rollout/ar_rollout.py",
             "            self.frame_cache.put(frame_ids, full_steps[-1].raw_kv)\n            return",
             "            self.frame_cache.put(frame_ids, full_steps[-1].raw_kv)",
             ("tests/rollout/test_context_modes.py::test_last_step_caches_without_an_extra_pass_and_needs_a_full_step",),
             "the last_step context mode also runs the incremental mode's K/V pass"),
    Mutation("nft_advantages_of_the_other_sample", "fvtools/train_nft.py",
             "advantages[index:index + 1].to(device)", "advantages.flip(0)[index:index + 1].to(device)",
             ("tests/recipes/test_train_nft.py::test_step_trains_each_sample_with_its_own_advantage_on_the_sampler_grid",),
             "each sample trains with another sample's advantage"),
    Mutation("df_sft_one_level_per_frame", "fvtools/train_df_sft.py",
             "            sigma_frames = torch.full((x0.shape[2],), sigma, dtype=torch.float32)",
             "            sigma_frames = torch.full((x0.shape[2],), sigma, dtype=torch.float32) * "
             "torch.linspace(1.0, 0.9, x0.shape[2])",
             ("tests/recipes/test_train_df_sft.py::test_df_sft_draws_one_noise_level_per_chunk",),
             "df_sft noises the frames of a chunk at different levels"),
    Mutation('revisit_target_sign_flipped', 'predictor_training/predictor/self_rollout.py',
             'return slots, (latent - first) / sigma',
             'return slots, (first - latent) / sigma',
             ('tests/predictor/test_self_rollout.py::test_the_return_term_pulls_a_revisited_latent_onto_its_first_visit',),
             'the return term pushes away from the first visit'),
    Mutation('revisit_target_keeps_the_latent_graph', 'predictor_training/predictor/self_rollout.py',
             'latent = call.latent.detach().float()[:, :, slots]',
             'latent = call.latent.float()[:, :, slots]',
             ('tests/predictor/test_self_rollout.py::test_the_return_term_pulls_a_revisited_latent_onto_its_first_visit',),
             'the return label carries the latent graph'),
    Mutation('revisit_target_reads_an_uncommitted_first_visit', 'predictor_training/predictor/self_rollout.py',
             'if frames.start <= latent < frames.stop and first < frames.start]',
             'if frames.start <= latent < frames.stop and first < frames.stop]',
             ('tests/predictor/test_self_rollout.py::test_the_return_term_pulls_a_revisited_latent_onto_its_first_visit',),
             'the return term reads a first visit the chunk has not committed'),
]


def tracked_files() -> list[str]:
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO_ROOT, capture_output=True, check=True)
    return [name for name in listing.stdout.decode().split("\0") if name]


def copy_project(target: Path) -> None:
    for name in tracked_files():
        source = REPO_ROOT / name
        if source.is_file():
            destination = target / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)


def apply(mutation: Mutation, root: Path) -> str | None:
    """Mutate the copy; returns a problem (stale text) or None."""
    path = root / mutation.file
    if not path.is_file():
        return f"{mutation.file} does not exist"
    text = path.read_text()
    count = text.count(mutation.original)
    if count != 1:
        return f"{mutation.file}: the original text occurs {count} times (expected exactly once)"
    path.write_text(text.replace(mutation.original, mutation.mutated))
    return None


def run_tests(mutation: Mutation, root: Path, timeout: int) -> tuple[bool, float, str]:
    """(caught, seconds, last output line)."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                 *mutation.tests], cwd=root, env=env, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        return True, time.perf_counter() - start, "timed out (counted as caught: the tests did not pass)"
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return result.returncode != 0, time.perf_counter() - start, lines[-1] if lines else result.stderr[-200:]


def missing_tests(mutations: list[Mutation]) -> dict[str, list[str]]:
    """{mutation name: its test ids that pytest does not collect in this checkout}. A test that was renamed or moved
    would otherwise count its mutation as caught: pytest fails on a node id it cannot find."""
    def collect(tests: list[str]) -> list[str]:
        result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p",
                                 "no:cacheprovider", *tests], cwd=REPO_ROOT, capture_output=True, text=True)
        return [line.strip() for line in result.stdout.splitlines() if "::" in line]

    def found_in(collected: list[str], test: str) -> bool:
        if "::" in test:
            return any(node == test or node.startswith(test + "[") for node in collected)
        return any(node.startswith(test + "::") for node in collected)

    wanted = sorted({test for mutation in mutations for test in mutation.tests})
    collected = collect(wanted)  # one collection; pytest collects nothing when one of them is not found
    absent = {test for test in wanted if not found_in(collected, test)}
    absent = {test for test in absent if not found_in(collect([test]), test)}  # then one by one
    return {mutation.name: [test for test in mutation.tests if test in absent] for mutation in mutations
            if absent & set(mutation.tests)}


def check_imports_come_from(root: Path) -> None:
    """The copy, not the installed checkout, must be what the tests import."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    found = subprocess.run([sys.executable, "-c", "import predictor_training, sys; print(predictor_training.__file__)"],
                           cwd=root, env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"mutation_check: the tests would import {found}, not the mutated copy in {root}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="run only these mutations (names)")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--check_tests", action="store_true",
                        help="check that pytest collects every test the chosen mutations name (nothing mutated), exit")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutation's test run (default 900)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"--only: unknown mutations {sorted(unknown)}; --list shows them")
    if args.list:
        for mutation in MUTATIONS:
            print(f"{mutation.name:45s} {mutation.file}: {mutation.why}")
        return 0
    if args.check_tests:
        missing = missing_tests(chosen)
        for name, tests in missing.items():
            print(f"{name:45s} MISSING  {' '.join(tests)}")
        print(f"{len(chosen)} mutations: {len(chosen) - len(missing)} name only tests pytest collects, "
              f"{len(missing)} name a missing test")
        return 1 if missing else 0
    survivors, stale = [], []
    missing = missing_tests(chosen)  # a test pytest cannot find fails, so its mutation would read as caught
    print(f"{'mutation':45s} {'result':8s} {'seconds':>8s}  tests")
    for mutation in chosen:
        if mutation.name in missing:
            stale.append(mutation.name)
            print(f"{mutation.name:45s} {'STALE':8s} {'':>8s}  no such test: {' '.join(missing[mutation.name])}",
                  flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix="mutation_") as folder:
            root = Path(folder)
            copy_project(root)
            check_imports_come_from(root)
            problem = apply(mutation, root)
            if problem is not None:
                stale.append(mutation.name)
                print(f"{mutation.name:45s} {'STALE':8s} {'':>8s}  {problem}", flush=True)
                continue
            caught, seconds, last = run_tests(mutation, root, args.timeout)
        if not caught:
            survivors.append(mutation.name)
        print(f"{mutation.name:45s} {'caught' if caught else 'SURVIVED':8s} {seconds:8.1f}  "
              f"{' '.join(mutation.tests)} ({last})", flush=True)
    print(f"\n{len(chosen)} mutations: {len(chosen) - len(survivors) - len(stale)} caught, {len(survivors)} survived"
          f"{' ' + str(survivors) if survivors else ''}, {len(stale)} stale{' ' + str(stale) if stale else ''}")
    return 1 if survivors or stale else 0


if __name__ == "__main__":
    sys.exit(main())
