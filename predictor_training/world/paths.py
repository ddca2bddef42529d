"""Camera paths of the demo world, in WorldPlay's pose-string action vocabulary, and their per-video-frame cameras.

``make_pose_string(seed, num_latents)`` draws segments of a few latents each (``SEGMENT_LENGTH_RANGE``), each one
motion from ``MOTION_WEIGHTS`` (w / s / a / d, left / right, and translation + yaw or translation + translation
combinations such as "w+left" or "w+d"), never the same motion twice in a row, until exactly ``num_latents - 1``
steps are used (the last segment is cut to fit): e.g. "w-6, w+left-5, right-8, ...". ``camera.parse_pose_string``
reads it; ``camera.pose_string_to_json`` turns it into the inference-format pose JSON (one key per latent).

``video_frame_cameras(pose_string, num_frames)`` gives the camera of every VIDEO frame (4 per latent step, the VAE's
temporal factor): frame 4i is exactly latent pose i of ``camera.camera_trajectory_from_motions``; frames 4i + k
(k = 1, 2, 3) apply k/4 of step i+1's motion from pose i, in the same order as a whole step (yaw, then pitch, then
the forward and right moves along the partially rotated axes).

``make_revisit_pose_string(seed, num_latents, kind)`` draws paths that come back EXACTLY to cameras seen before
(``REVISIT_KINDS``: turn away and back, forward and back, a loop, a look-around; see the section below), and
``make_path_pose_string(seed, num_latents, kind)`` picks between the two generators by ``kind``.
"""

from __future__ import annotations

import random
from typing import Mapping

import numpy as np

from predictor_training.rollout.camera import FRAMES_PER_LATENT, camera_trajectory_from_motions, parse_pose_string

# motion -> relative weight of being drawn for a segment
MOTION_WEIGHTS: dict[str, float] = {
    "w": 3.0,
    "w+left": 2.0,
    "w+right": 2.0,
    "left": 1.5,
    "right": 1.5,
    "s": 1.0,
    "a": 1.0,
    "d": 1.0,
    "s+left": 0.5,
    "s+right": 0.5,
    "a+left": 0.5,
    "a+right": 0.5,
    "d+left": 0.5,
    "d+right": 0.5,
    "w+a": 0.5,
    "w+d": 0.5,
}
VOCABULARY = ("w", "s", "a", "d", "left", "right")  # the words the motions are made of
SEGMENT_LENGTH_RANGE = (3, 8)  # latents per segment, inclusive


def make_pose_string(seed: int, num_latents: int = 32) -> str:
    """A deterministic random pose string of exactly ``num_latents - 1`` steps (see the module docstring)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(num_latents, int) or num_latents < 2:
        raise ValueError(f"num_latents must be an int >= 2 (at least one step), got {num_latents!r}")
    rng = random.Random(seed)
    names = list(MOTION_WEIGHTS)
    weights = [MOTION_WEIGHTS[name] for name in names]
    remaining = num_latents - 1
    segments: list[str] = []
    previous = None
    while remaining > 0:
        motion = previous
        while motion == previous:
            motion = rng.choices(names, weights=weights)[0]
        length = min(remaining, rng.randint(*SEGMENT_LENGTH_RANGE))
        segments.append(f"{motion}-{length}")
        remaining -= length
        previous = motion
    return ", ".join(segments)


def _partial_step(motion: Mapping[str, float], fraction: float) -> np.ndarray:
    """4x4 relative camera motion of ``fraction`` of one step, from the identity."""
    scaled = {key: value * fraction for key, value in motion.items()}
    return camera_trajectory_from_motions([scaled])[1]


def video_frame_cameras(pose_string: str, num_frames: int = 125) -> np.ndarray:
    """Camera-to-world [num_frames, 4, 4] float64 of every video frame of a pose string's path.

    ``num_frames`` must be 4 * steps + 1 (125 frames for 31 steps / 32 latents). Frame 4i equals latent pose i of
    ``camera.pose_string_to_json(pose_string)`` bit for bit.
    """
    motions = parse_pose_string(pose_string)
    expected = FRAMES_PER_LATENT * len(motions) + 1
    if num_frames != expected:
        raise ValueError(
            f"pose string {pose_string!r} has {len(motions)} steps ({len(motions) + 1} latents), which make "
            f"{expected} video frames (4 per step + 1), got num_frames={num_frames}"
        )
    latents = camera_trajectory_from_motions(motions)
    cameras = np.empty((num_frames, 4, 4), dtype=np.float64)
    for step, motion in enumerate(motions):
        start = latents[step]
        cameras[FRAMES_PER_LATENT * step] = start
        for k in range(1, FRAMES_PER_LATENT):
            cameras[FRAMES_PER_LATENT * step + k] = start @ _partial_step(motion, k / FRAMES_PER_LATENT)
    cameras[-1] = latents[-1]
    return cameras


def pose_string_words(pose_string: str) -> list[str]:
    """The motion words of a pose string ("w+left-5, s-3" -> ["w", "left", "s"])."""
    words = []
    for command in (part.strip() for part in pose_string.split(",")):
        if command:
            words.extend(token.strip() for token in command.split("-")[0].split("+"))
    return words


# =============================================================================================================
# Revisit paths: camera paths that come back exactly to cameras seen before
# =============================================================================================================
# A revisit path is made of "pure" segments (one motion word each: w, s, a, d, left or right). A pure segment of n
# steps is undone exactly by n steps of its opposite word, because a pure yaw leaves the position alone and a pure
# move keeps the orientation. So an excursion E = [m1-n1, ..., mk-nk] followed by its reversed opposite
# [~mk-nk, ..., ~m1-n1] ends on the camera where E started, and every camera of the way back is a camera of the
# way out (up to float rounding, ~1e-15). Combined words (w+left) are not used in excursions: their yaw comes
# first within a step, so "s+right" does not undo "w+left".
REVISIT_KINDS = ("turn_back", "forward_back", "loop", "look_around")
PATH_KINDS = ("generator", *REVISIT_KINDS)
OPPOSITE = {"w": "s", "s": "w", "a": "d", "d": "a", "left": "right", "right": "left"}
MOVE_WEIGHTS = {"w": 3.0, "s": 1.0, "a": 1.0, "d": 1.0}  # translation word of an excursion -> weight
LEAD_IN_PROBABILITY = 0.3  # a revisit path first runs one generator segment, so the revisited camera is not the start
LEAD_IN_RANGE = (2, 6)  # steps of that segment
TURN_RANGE = (6, 15)  # turn_back: 18-45 degrees away
MOVE_RANGE = (5, 15)  # forward_back: 0.4-1.2 units away
NESTED_PROBABILITY = 0.3  # turn_back / forward_back: a second, inner pure segment of the other type
LOOK_RANGE = (3, 7)  # look_around: 9-21 degrees to each side
LOOP_SIDE_RANGE = (3, 7)  # loop: the rectangle's sides, in steps


def _generator_segments(rng: random.Random, steps: int, previous: str | None) -> list[tuple[str, int]]:
    """Segments drawn like ``make_pose_string`` until exactly ``steps`` steps are used."""
    names = list(MOTION_WEIGHTS)
    weights = [MOTION_WEIGHTS[name] for name in names]
    segments = []
    while steps > 0:
        motion = previous
        while motion == previous:
            motion = rng.choices(names, weights=weights)[0]
        length = min(steps, rng.randint(*SEGMENT_LENGTH_RANGE))
        segments.append((motion, length))
        steps -= length
        previous = motion
    return segments


def _excursion(rng: random.Random, kind: str, budget: int) -> list[tuple[str, int]]:
    """The way out of a revisit path of ``kind`` (at most half of ``budget`` steps; look_around and loop: all of
    their out-and-back pattern, see ``make_revisit_pose_string``)."""
    turn = rng.choice(("left", "right"))
    move = rng.choices(list(MOVE_WEIGHTS), weights=list(MOVE_WEIGHTS.values()))[0]
    half = budget // 2
    if kind == "turn_back":
        steps = rng.randint(min(TURN_RANGE[0], half), min(TURN_RANGE[1], half))
        if rng.random() < NESTED_PROBABILITY and steps >= 6:
            inner = rng.randint(2, steps - 3)  # move, then turn; back: turn back, then move back
            return [(move, inner), (turn, steps - inner)]
        return [(turn, steps)]
    if kind == "forward_back":
        steps = rng.randint(min(MOVE_RANGE[0], half), min(MOVE_RANGE[1], half))
        if rng.random() < NESTED_PROBABILITY and steps >= 6:
            inner = rng.randint(2, steps - 3)  # turn, then move along the turned axis
            return [(turn, inner), (move, steps - inner)]
        return [(move, steps)]
    if kind == "look_around":  # turn one way, sweep through the start to the other side, come back to the middle
        steps = rng.randint(min(LOOK_RANGE[0], budget // 4), min(LOOK_RANGE[1], budget // 4))
        return [(turn, steps), (OPPOSITE[turn], 2 * steps), (turn, steps)]
    if kind == "loop":  # a rectangle walked without turning: along, sideways, back, sideways back
        along = rng.choices(("w", "s"), weights=(3.0, 1.0))[0]
        side = rng.choice(("a", "d"))
        quarter = budget // 4
        first = rng.randint(min(LOOP_SIDE_RANGE[0], quarter), min(LOOP_SIDE_RANGE[1], quarter))
        second = rng.randint(min(LOOP_SIDE_RANGE[0], quarter), min(LOOP_SIDE_RANGE[1], budget // 2 - first))
        return [(along, first), (side, second), (OPPOSITE[along], first), (OPPOSITE[side], second)]
    raise ValueError(f"unknown revisit kind {kind!r}; expected one of {REVISIT_KINDS}")


def make_revisit_pose_string(seed: int, num_latents: int = 32, kind: str = "turn_back") -> str:
    """A deterministic pose string of exactly ``num_latents - 1`` steps whose camera comes back to earlier cameras.

    kinds (``REVISIT_KINDS``):
      * turn_back: turn 18-45 degrees left or right and turn back (sometimes with a move before the turn, undone
        after it);
      * forward_back: walk 0.4-1.2 units (mostly forward; sometimes backward or sideways, sometimes along a turned
        axis) and walk back along the same line;
      * loop: walk a rectangle without turning (along, sideways, back, sideways back) to the start;
      * look_around: turn k steps one way, 2k the other way (through the start view), k back to the middle.
    With probability ``LEAD_IN_PROBABILITY`` one generator segment comes first (so the revisited camera is not the
    start camera); the steps left after the revisit are generator segments (``make_pose_string``'s draws).
    """
    if kind not in REVISIT_KINDS:
        raise ValueError(f"unknown revisit kind {kind!r}; expected one of {REVISIT_KINDS}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(num_latents, int) or num_latents < 9:
        raise ValueError(f"a revisit path needs num_latents >= 9, got {num_latents!r}")
    rng = random.Random(seed)
    steps = num_latents - 1
    segments: list[tuple[str, int]] = []
    if rng.random() < LEAD_IN_PROBABILITY and steps >= 24:
        segments += _generator_segments(rng, rng.randint(*LEAD_IN_RANGE), None)
    out = _excursion(rng, kind, steps - sum(length for _, length in segments))
    segments += out
    if kind in ("turn_back", "forward_back"):
        segments += [(OPPOSITE[motion], length) for motion, length in reversed(out)]
    remaining = steps - sum(length for _, length in segments)
    segments += _generator_segments(rng, remaining, segments[-1][0])
    return ", ".join(f"{motion}-{length}" for motion, length in segments)


def make_path_pose_string(seed: int, num_latents: int = 32, kind: str = "generator") -> str:
    """The pose string of a path of ``kind`` (``PATH_KINDS``): ``make_pose_string`` for "generator", else
    ``make_revisit_pose_string``."""
    if kind == "generator":
        return make_pose_string(seed, num_latents)
    return make_revisit_pose_string(seed, num_latents, kind)
