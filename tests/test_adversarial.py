"""DisCa-style adversarial pieces (predictor_training/methods/adversarial.py): the discriminator separates real from fake
hidden tokens on a toy, neither side's loss reaches the other side's parameters, R1 trains D, the weight warms up."""

import torch

from predictor_training.methods.adversarial import (
    HiddenDiscriminator,
    adversarial_weight,
    discriminator_loss,
    generator_loss,
    r1_penalty,
)
from predictor_training.runtime.random_streams import stream_generator

HIDDEN, TOKENS, BATCH = 16, 12, 32


def real_and_fake(generator: torch.Generator, fake_model: torch.nn.Module):
    real = torch.randn(BATCH, TOKENS, HIDDEN, generator=generator) + 1.0
    fake = fake_model(torch.randn(BATCH, TOKENS, HIDDEN, generator=generator))
    timestep = torch.randint(0, 1000, (BATCH,), generator=generator).float()
    return real, fake, timestep


def test_discriminator_separates_real_from_fake():
    torch.manual_seed(0)
    discriminator = HiddenDiscriminator(HIDDEN, width=32)
    fake_model = torch.nn.Linear(HIDDEN, HIDDEN)  # a generator that is not trained here
    optimizer = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
    generator = stream_generator(0)
    for _ in range(150):
        real, fake, timestep = real_and_fake(generator, fake_model)
        loss, metrics = discriminator_loss(discriminator, real, fake, timestep)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    real, fake, timestep = real_and_fake(generator, fake_model)
    _, metrics = discriminator_loss(discriminator, real, fake, timestep)
    assert metrics["discriminator/accuracy"] > 0.95, metrics


def test_neither_loss_leaks_into_the_other_side():
    torch.manual_seed(1)
    discriminator = HiddenDiscriminator(HIDDEN, width=32)
    fake_model = torch.nn.Linear(HIDDEN, HIDDEN)
    real, fake, timestep = real_and_fake(stream_generator(1), fake_model)
    context = torch.randn(BATCH, HIDDEN)
    discriminator_loss(discriminator, real, fake, timestep, context)[0].backward()
    assert all(parameter.grad is None for parameter in fake_model.parameters())
    assert all(parameter.grad is not None for parameter in discriminator.parameters())
    discriminator.zero_grad(set_to_none=True)
    generator_loss(discriminator, fake, timestep, context).backward()
    assert all(parameter.grad is None for parameter in discriminator.parameters())
    assert all(parameter.grad is not None and parameter.grad.abs().sum() > 0 for parameter in fake_model.parameters())


def test_r1_trains_the_discriminator_and_the_weight_warms_up():
    torch.manual_seed(2)
    discriminator = HiddenDiscriminator(HIDDEN, width=32)
    real, _, timestep = real_and_fake(stream_generator(2), torch.nn.Identity())
    penalty = r1_penalty(discriminator, real, timestep)
    assert penalty > 0
    penalty.backward()
    assert discriminator.token_in.weight.grad.abs().sum() > 0
    assert [adversarial_weight(step, 0.1, 10) for step in (0, 5, 10, 50)] == [0.0, 0.05, 0.1, 0.1]
    assert adversarial_weight(0, 0.1, 0) == 0.1
