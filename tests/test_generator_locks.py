"""The cuda backend's seeded blocks (``cuda.GeneratorLocks``), tested without a GPU: CPU generators
stand in for the GPUs' default generators. Workers of different GPUs issue random layers at the same
time once the model is known to draw nothing on the host; workers sharing a GPU take turns; a model
that draws on the host keeps the CPU generator locked; every draw replays from its seed."""

from __future__ import annotations

import threading

import torch

from roundpipe.backend.cuda import GeneratorLocks

torch.set_num_threads(1)

WAIT_S = 2.0


def _both_inside(locks: GeneratorLocks, gpus: tuple[int, int], generators, host) -> bool:
    """Whether two blocks, on ``gpus[0]`` and ``gpus[1]``, are ever inside at the same time: each
    waits inside for the other to enter (the second gives up after ``WAIT_S``)."""
    inside = [threading.Event(), threading.Event()]
    met = [False, False]

    def block(k: int) -> None:
        with locks.seeded(gpus[k], generators[k], host, seed=k):
            inside[k].set()
            met[k] = inside[1 - k].wait(WAIT_S)

    threads = [threading.Thread(target=block, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return met[0] and met[1]


def test_workers_of_two_gpus_issue_random_layers_at_once_when_nothing_draws_on_the_host():
    locks = GeneratorLocks({0, 1})
    host = torch.Generator()
    gens = (torch.Generator(), torch.Generator())
    assert not _both_inside(locks, (0, 1), gens, host)  # not known yet: the host lock is held
    locks.every_layer_seeded()  # a step completed and no block moved the host generator
    assert locks.host_draws is False
    assert _both_inside(locks, (0, 1), gens, host)


def test_workers_sharing_one_gpu_take_turns_with_its_generator():
    locks = GeneratorLocks({0})
    locks.every_layer_seeded()
    gen = torch.Generator()
    assert not _both_inside(locks, (0, 0), (gen, gen), torch.Generator())


def test_a_model_that_draws_on_the_host_keeps_the_host_generator_locked():
    locks = GeneratorLocks({0, 1})
    host = torch.Generator()
    with locks.seeded(0, torch.Generator(), host, seed=3):
        torch.rand(1, generator=host)  # peft LoHa's module dropout, say
    locks.every_layer_seeded()
    assert locks.host_draws is True
    assert not _both_inside(locks, (0, 1), (torch.Generator(), torch.Generator()), host)


def test_a_seeded_block_replays_its_draws_and_leaves_the_generators_as_they_were():
    locks = GeneratorLocks({0})
    device, host = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    before = device.get_state(), host.get_state()

    def draws(seed: int):
        with locks.seeded(0, device, host, seed):
            return torch.rand(4, generator=device), torch.rand(2, generator=host)

    first, again, other = draws(5), draws(5), draws(6)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])
    assert torch.equal(device.get_state(), before[0]) and torch.equal(host.get_state(), before[1])
    locks.every_layer_seeded()  # host draws known: the host generator is still seeded per block
    assert torch.equal(draws(5)[1], first[1])


def test_the_backend_hears_of_each_completed_step(monkeypatch):
    from support.tiny_models import make_batch, make_model

    import roundpipe
    from roundpipe.backend.cpu import CpuBackend

    completed: list[int] = []
    monkeypatch.setattr(CpuBackend, "step_completed", lambda self: completed.append(1), raising=False)
    config = roundpipe.RunConfig(devices="cpu:2", policy="roundpipe", partition=None, num_microbatches=2)
    batch = make_batch(batch=4)
    with roundpipe.wrap(make_model("llama"), config) as pipe:
        pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
        pipe.forward_backward(batch["input_ids"], labels=batch["labels"])
    assert completed == [1, 1]
