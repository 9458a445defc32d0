"""The simulator: closed forms in the ideal setting, copies, memory, optimizer modes, tuner, CLI."""

from __future__ import annotations

import ast
import gc
import json
import pathlib
from dataclasses import replace

import pytest

from roundpipe.errors import ConfigError
from roundpipe.partition.cost import model_costs
from roundpipe.partition.memory import device_reserve_bytes
from roundpipe.presets import GIB, load_hardware, load_model_config
from roundpipe.schedule import POLICIES, build_table
from roundpipe.schedule.formulas import closed_form
from roundpipe.schedule.table import Partition, ScheduleTable
from roundpipe.schedule.timeline import LANES, Span, Timeline
from roundpipe.sim.options import SimOptions
from roundpipe.sim.scenario import Scenario, check_scenario, run_scenario
from roundpipe.sim.simulator import simulate, without_costs
from roundpipe.sim.tune import refine, stage_blame, tune
from roundpipe.sim.workload import Workload, device_ops, uniform_workload, workload_from_costs

UNIT = {"F": 1, "B": 2, "I": 1, "W": 1}


def P(n: int) -> Partition:
    return Partition.per_layer(n)


def replay(table: ScheduleTable) -> int:
    """Strict in-order execution of the table on the unit grid (reference, independent of the simulator)."""
    finish, free = {}, [0] * table.num_devices
    for t in table.execution_order():
        start = max([free[t.device]] + [finish[k] for k in table.dependencies(t)])
        finish[t.key] = free[t.device] = start + UNIT[t.kind]
    return max(free)


def ideal(table: ScheduleTable, n_layers: int):
    hw = load_hardware(f"{table.num_devices}xrtx4090")
    return simulate(table, uniform_workload(n_layers, 1.0, 2.0), hw, without_costs())


def shapes(policy: str, microbatch_counts=(1, 2, 3, 4, 8, 16)):
    for devices in (1, 2, 3, 4, 8):
        for microbatches in microbatch_counts:
            stages = [2 * devices] if policy in ("interleaved", "hanayo") else [devices]
            if policy == "roundpipe":
                stages = [devices, devices + 1, 2 * devices]
            for s in stages:
                try:
                    table = build_table(policy, P(s), P(s), devices, microbatches)
                except Exception:
                    continue
                yield devices, microbatches, s, table


def in_domain(policy, devices, microbatches, stages, f=1.0, b=2.0):
    """The closed form of the shape, or None where the formula declares the shape outside its domain."""
    try:
        return closed_form(policy, devices, microbatches, stages, f=f, b=b)
    except ConfigError:
        return None


# ------------------------------------------------------------------ the ideal setting: closed forms


@pytest.mark.parametrize("policy", list(POLICIES))
def test_without_costs_the_simulator_equals_the_closed_forms(policy):
    checked = 0
    for devices, m, s, table in shapes(policy, (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)):
        cf = in_domain(policy, devices, m, s)
        if cf is None:
            assert policy in ("chimera", "hanayo"), (policy, devices, m, s)
            continue
        r = ideal(table, s)
        assert r.iteration_s == cf.makespan, (devices, m, s)
        assert r.bubble_total == pytest.approx(cf.idle_over_total, abs=1e-12)
        assert r.bubble_ideal == pytest.approx(cf.idle_over_ideal, abs=1e-12)
        assert max(r.peak_activations) == cf.peak_activations, (devices, m, s)
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 3.0), (2.0, 5.0)])
def test_chimera_closed_form_holds_for_any_backward_at_least_as_long_as_the_forward(f, b):
    for devices in (2, 4, 6, 8):
        for m in (2 * devices, 2 * devices + 2, 4 * devices):
            table = build_table("chimera", P(devices), P(devices), devices, m)
            r = simulate(
                table, uniform_workload(devices, f, b), load_hardware(f"{devices}xrtx4090"), without_costs()
            )
            cf = closed_form("chimera", devices, m, f=f, b=b)
            assert r.iteration_s == cf.makespan, (devices, m)
            assert max(r.peak_activations) == cf.peak_activations


def test_chimera_and_hanayo_closed_forms_name_their_domain():
    with pytest.raises(ConfigError, match="M >= 2D"):
        closed_form("chimera", 4, 6)
    with pytest.raises(ConfigError, match="b >= f"):
        closed_form("chimera", 4, 8, f=2.0, b=1.0)
    with pytest.raises(ConfigError, match="one wave"):
        closed_form("hanayo", 2, 8, stages=8)
    with pytest.raises(ConfigError, match="b = 2f"):
        closed_form("hanayo", 2, 8, f=1.0, b=1.0)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_without_costs_the_simulator_replays_every_table_exactly(policy):
    for _, _, s, table in shapes(policy):
        r = ideal(table, s)
        assert r.iteration_s == replay(table)


def test_hanayo_tables_never_beat_the_bound_of_their_placement():
    """max(published step, chain of one microbatch + two turn-around passes per further one)."""
    for devices, m, s, table in shapes("hanayo"):
        waves = s // (2 * devices)
        bound = max((2 * waves * m + devices - 1) * 3, 2 * waves * devices * 3 + 2 * (m - 1) * 2)
        assert ideal(table, s).iteration_s >= bound
        if m <= 2:
            assert ideal(table, s).iteration_s == bound


# ------------------------------------------------------------------ timelines


def test_timeline_round_trips_and_exports_one_process_per_device_and_thread_per_lane(tmp_path):
    r = ideal(build_table("1f1b", P(2), P(2), 2, 2), 2)
    tl = r.timeline
    assert tl.makespan == r.iteration_s and tl.busy(0) == 6.0
    assert Timeline.from_dict(json.loads(json.dumps(tl.to_dict()))).spans == tl.spans
    trace = tl.to_chrome_trace()
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {(1, "device 0"), (2, "device 1")}
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads <= set(LANES) and "compute" in threads
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl.spans) and all(e["dur"] >= 0 for e in xs)
    tl.save_chrome_trace(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_a_span_must_name_a_known_lane_and_not_end_before_it_starts():
    with pytest.raises(ConfigError, match="lane"):
        Span(0, "gpu", "F0.0", "F", 0.0, 1.0)
    with pytest.raises(ConfigError, match="before it starts"):
        Span(0, "compute", "F0.0", "F", 2.0, 1.0)
    tl = Timeline([Span(0, "compute", "a", "F", 0, 2), Span(0, "compute", "b", "F", 1, 3)])
    assert tl.busy(0) == 3 and tl.bubble_fraction() == 0.0


def test_gantt_png_is_written_for_a_simulated_step(tmp_path):
    pytest.importorskip("matplotlib")
    from roundpipe.sim.gantt import save_gantt

    r = run_scenario(Scenario("qwen3-0.6b", "2xrtx4090", seq_len=256, global_batch=4, lora_rank=8))
    save_gantt(r.timeline, str(tmp_path / "g.png"), title="t")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------ copies, weights, memory


def copy_workload(n: int, param: int = 0, act: int = 0) -> Workload:
    return uniform_workload(n, 1e-3, 2e-3, param_bytes=param, act_in_bytes=act)


def test_copies_cost_time_and_the_shared_uplink_slows_gpus_behind_one_switch():
    table = build_table("roundpipe", P(8), P(8), 2, 4)
    work = copy_workload(8, param=0, act=200_000_000)
    one_switch = load_hardware("2xrtx4090", gpus_per_switch=2)
    two_switches = load_hardware("2xrtx4090", gpus_per_switch=1)
    free = simulate(table, work, one_switch, SimOptions(transfers=False)).iteration_s
    shared = simulate(table, work, one_switch).iteration_s
    alone = simulate(table, work, two_switches).iteration_s
    assert free < alone < shared


def test_roundpipe_streams_each_stage_once_per_deal_and_holds_at_most_two_stages():
    layers, param = 8, 1 << 30
    work = copy_workload(layers, param=param)
    hw = load_hardware("2xrtx4090")
    r = simulate(build_table("roundpipe", P(layers), P(layers), 2, 4), work, hw)
    # at most once per deal (forward deals, the fused head, backward deals); a layer the next deal
    # on the same device also needs stays resident
    assert layers * param < r.h2d_bytes <= (2 * layers - 1) * param
    assert max(r.peak_gpu_bytes) - device_reserve_bytes(hw) <= 2 * param
    assert r.weights_streamed == (True, True)


def test_weight_bound_tables_upload_each_layer_once_when_it_fits_and_stream_when_not():
    work = copy_workload(8, param=1 << 30)
    table = build_table("interleaved", P(8), P(8), 2, 4)  # four stages per device
    r = simulate(table, work, load_hardware("2xrtx4090"))
    assert r.weights_streamed == (False, False) and r.h2d_bytes == 8 << 30
    small = load_hardware("2xrtx4090", gpu_memory_bytes=int(2.5 * GIB), gpu_workspace_reserve_bytes=0)
    r = simulate(table, work, small)
    assert r.weights_streamed == (True, True) and r.h2d_bytes > 8 << 30
    assert "streamed" in r.notes[0] and max(r.peak_gpu_bytes) - device_reserve_bytes(small) <= 2 << 30


def test_a_device_over_its_memory_does_not_fit_and_says_where():
    work = copy_workload(2, param=4 << 30)
    hw = load_hardware("1xrtx4090", gpu_memory_bytes=4 << 30)
    r = simulate(build_table("1f1b", P(1), P(1), 1, 2), replace(work, layers=work.layers[:1]), hw)
    assert not r.fits and "device 0 needs" in r.reason and "weights 4.00 GiB" in r.reason


def test_host_memory_limit_is_checked():
    r = run_scenario(
        Scenario(
            "qwen3-0.6b", load_hardware("2xrtx4090", host_memory_bytes=1 << 30), seq_len=256, global_batch=4
        )
    )
    assert not r.fits and "host memory" in r.reason


def test_device_ops_follow_the_runtime_data_flow():
    table = build_table("roundpipe", Partition((0, 2, 4)), Partition((0, 1, 3, 4)), 2, 1)
    ops = [op for row in device_ops(table) for op in row]
    fused = next(op for op in ops if op.kind == "FB")
    assert fused.fwd_layers == range(2, 3) and fused.bwd_layers == range(3, 4)
    assert ("act", 2, 0) in fused.consumes and ("grad", 3, 0) in fused.produces
    first = next(op for op in ops if op.label == "F0.0")
    assert first.produces == [("act", 1, 0), ("act", 2, 0)]  # a backward start inside, and its output


def _context_builds(table) -> list[int]:
    """Per device, the operations that run another microbatch than the one before them in the
    step (what the worker builds a layer context for), counted from the shared data flow; an
    operation with no layers to run (a forward nobody consumes) builds nothing."""
    from roundpipe.schedule.flow import device_flows

    counts = []
    for row in device_flows(table):
        last, n = None, 0
        for work, tasks in row:
            if len(work.layers) and tasks[0].microbatch != last:
                n, last = n + 1, tasks[0].microbatch
        counts.append(n)
    return counts


@pytest.mark.parametrize(("policy", "stages"), [("gpipe", 1), ("1f1b", 1), ("roundpipe", 4)])
def test_a_context_build_is_charged_before_each_operation_on_another_microbatch(policy, stages):
    """On one device the step is serial: it grows by ``context_s`` per microbatch switch, exactly
    (1F1B's F and B of a microbatch follow each other and share one build; stage-major orders
    switch at every operation)."""
    base = uniform_workload(4, 1.0, 2.0, recompute=True)
    cut = Partition.per_layer(4) if stages == 4 else Partition((0, 4))
    table = build_table(policy, cut, cut, 1, 4)
    opts = SimOptions(transfers=False, optimizer_time=False)
    plain = simulate(table, base, load_hardware("1xcpu"), opts)
    charged = simulate(table, replace(base, context_s=0.25), load_hardware("1xcpu"), opts)
    (builds,) = _context_builds(table)
    assert builds >= 4  # every microbatch at least once
    assert charged.iteration_s == pytest.approx(plain.iteration_s + 0.25 * builds)
    assert charged.compute_busy_s[0] == pytest.approx(plain.compute_busy_s[0] + 0.25 * builds)


def test_a_fused_pair_on_one_microbatch_builds_its_context_once():
    table = build_table("roundpipe", Partition((0, 2, 4)), Partition((0, 1, 3, 4)), 1, 1)
    work = uniform_workload(4, 1.0, 2.0)
    opts = SimOptions(transfers=False, optimizer_time=False)
    delta = (
        simulate(table, replace(work, context_s=1.0), load_hardware("1xcpu"), opts).iteration_s
        - simulate(table, work, load_hardware("1xcpu"), opts).iteration_s
    )
    assert delta == pytest.approx(1.0)  # one microbatch: one build for the whole step


@pytest.mark.parametrize(("policy", "stages"), [("gpipe", 1), ("1f1b", 1), ("roundpipe", 4)])
def test_the_host_gap_before_each_operation_delays_the_device_but_is_not_compute(policy, stages):
    """``task_s``: the device stands idle that long before every operation with work while the host
    gets it going. On one device the step is serial: it grows by ``task_s`` per operation, exactly,
    and the compute busy time does not."""
    base = uniform_workload(4, 1.0, 2.0, recompute=True)
    cut = Partition.per_layer(4) if stages == 4 else Partition((0, 4))
    table = build_table(policy, cut, cut, 1, 4)
    opts = SimOptions(transfers=False, optimizer_time=False, record_timeline=True)
    plain = simulate(table, base, load_hardware("1xcpu"), opts)
    gapped = simulate(table, replace(base, task_s=0.125), load_hardware("1xcpu"), opts)
    operations = len([s for s in plain.timeline.spans if s.lane == "compute"])
    assert operations >= 2 * 4 * stages - 4  # every F and B of every microbatch (RoundPipe fuses the last)
    assert gapped.iteration_s == pytest.approx(plain.iteration_s + 0.125 * operations)
    assert gapped.compute_busy_s == pytest.approx(plain.compute_busy_s)
    starts = sorted(s.start for s in gapped.timeline.spans if s.lane == "compute")
    assert starts[0] == pytest.approx(0.125)  # the first operation waits for its host gap too


def test_a_negative_host_gap_is_refused():
    costs = model_costs(load_model_config("qwen3-0.6b"), 128, 1)
    with pytest.raises(ConfigError, match="task_s"):
        workload_from_costs(costs, load_hardware("1xrtx4090"), task_s=-0.001)


# ------------------------------------------------------------------ optimizer modes


def test_async_optimizer_overlaps_steps_and_sync_waits_for_the_updates():
    s = Scenario("qwen3-0.6b", "2xrtx4090", seq_len=512, global_batch=4)
    slow_cpu = load_hardware("2xrtx4090", host_memory_bw=2e9)
    sync = run_scenario(replace(s, hardware=slow_cpu))
    asyn = run_scenario(replace(s, hardware=slow_cpu, optimizer="async"))
    assert sync.optimizer_busy_s > 0.5
    assert asyn.iteration_s < sync.iteration_s
    free = run_scenario(s, SimOptions(optimizer_time=False))
    assert sync.iteration_s > free.iteration_s


# ------------------------------------------------------------------ scenarios, measured times, cpu devices


def test_measured_layer_times_replace_the_analytic_ones():
    s = Scenario("qwen3-0.6b", "2xcpu", seq_len=128, global_batch=2, lora_rank=4)
    base = run_scenario(s)
    costs = model_costs(__import__("roundpipe.presets", fromlist=["x"]).load_model_config("qwen3-0.6b"), 128)
    measured = {c.name: (0.5, 1.0) for c in costs if c.name.startswith("layers.")}
    slow = run_scenario(replace(s, times=measured))
    assert slow.iteration_s > base.iteration_s
    with pytest.raises(ConfigError, match="unknown layers"):
        run_scenario(replace(s, times={"nope": (1.0, 1.0)}))


def test_a_cpu_device_description_simulates_virtual_devices():
    hw = load_hardware("2xcpu", gpu_bf16_flops=1e10, gpu_host_link_bw=2e9)
    costs = model_costs(
        {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 256},
        seq_len=32,
    )  # fmt: skip
    work = workload_from_costs(costs, hw, times={c.name: (1e-3, 2e-3) for c in costs})
    table = build_table("roundpipe", Partition.per_layer(len(costs)), Partition.per_layer(len(costs)), 2, 4)
    r = simulate(table, work, hw)
    assert r.fits and r.iteration_s > 0 and r.timeline.meta["hardware"] == "2xcpu"


def test_simulate_leaves_the_cycle_collector_as_it_found_it(monkeypatch):
    table = build_table("1f1b", P(2), P(2), 2, 2)
    hw = load_hardware("2xrtx4090")
    assert gc.isenabled()
    simulate(table, uniform_workload(2, 1.0, 2.0), hw, without_costs())
    assert gc.isenabled()
    import roundpipe.sim.simulator as simulator_module

    def fail(self):
        assert not gc.isenabled()  # paused while the simulation runs
        raise RuntimeError("event loop failed")

    with monkeypatch.context() as m:
        m.setattr(simulator_module._Sim, "run", fail)
        with pytest.raises(RuntimeError, match="event loop failed"):
            simulate(table, uniform_workload(2, 1.0, 2.0), hw, without_costs())
    assert gc.isenabled()
    gc.disable()
    try:
        simulate(table, uniform_workload(2, 1.0, 2.0), hw, without_costs())
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(model="gpt5"), "known models: .*qwen3-8b"),
        (dict(hardware="8xfoo"), "known GPUs: .*rtx4090"),
        (dict(seq_len=0), "seq len must be a positive integer"),
        (dict(hardware="16xrtx4090"), "holds at most 8"),
        (dict(num_devices=9), "has 8"),
        (dict(microbatches=65), "use 1..64 microbatches"),
        (dict(policy="pipedream"), "unknown policy"),
        (dict(label_fraction=0.0), "label fraction .* must lie in"),
    ],
)
def test_bad_input_says_what_to_change(kwargs, match):
    s = Scenario(**{"model": "qwen3-0.6b", **kwargs})
    with pytest.raises(ConfigError, match=match):
        run_scenario(s)


def test_a_policy_that_cannot_take_the_shape_comes_back_as_not_fitting():
    r = run_scenario(Scenario("qwen3-0.6b", "4xrtx4090", "interleaved", seq_len=256, global_batch=6))
    assert not r.fits and "divisible" in r.reason


def test_weight_binding_leaves_no_room_for_a_235b_model_on_24_gb_cards():
    hw, _, _ = check_scenario(Scenario("qwen3-235b-a22b"))
    bound = run_scenario(Scenario("qwen3-235b-a22b", "8xrtx4090", "1f1b", global_batch=8, lora_rank=16))
    assert not bound.fits and "weights" in bound.reason
    assert bound.peak_gpu > hw.memory_bytes


# ------------------------------------------------------------------ tuner


def test_refinement_moves_a_boundary_away_from_the_bubble():
    work = uniform_workload(8, 1.0, 2.0)
    bad = Partition((0, 3, 4, 6, 8))  # stage 0 holds three layers, stage 1 one
    table = build_table("roundpipe", bad, Partition((0, 2, 4, 6, 8)), 2, 4)
    hw = load_hardware("2xrtx4090")
    opts = without_costs()
    start = simulate(table, work, hw, opts)
    fwd_blame, _ = stage_blame(start, table)
    assert max(fwd_blame, key=fwd_blame.get) == 0  # stage 0 keeps the next stage waiting

    class Prep:
        pass

    prep = Prep()
    prep.table, prep.workload, prep.hardware = table, work, hw
    new_table, res, moves = refine(prep, start, opts, deadline=float("inf"))
    assert moves >= 1 and res.iteration_s < start.iteration_s
    assert new_table.forward.bounds[:3] == (0, 2, 4)  # stage 0 gave its third layer away


def test_tuner_ranks_fitting_plans_by_throughput():
    r = tune(
        "qwen3-0.6b",
        "4xrtx4090",
        seq_len=512,
        global_batch=8,
        lora_rank=8,
        policies=["roundpipe", "1f1b"],
        time_budget_s=20,
    )
    fits = [c for c in r.ranked if c.fits]
    assert r.best.fits and r.best is r.ranked[0]
    assert [c.result.tokens_per_s for c in fits] == sorted(
        (c.result.tokens_per_s for c in fits), reverse=True
    )
    assert {c.policy for c in r.ranked} == {"roundpipe", "1f1b"}


def test_tuner_takes_a_model_config_as_any_mapping():
    """A scenario's model is a name or a Mapping; the tuner's grain alternatives read it the same way
    (a non-dict Mapping was passed to ``load_model_config`` as if it were a path)."""
    from types import MappingProxyType

    from roundpipe.presets import load_model_config

    config = MappingProxyType(load_model_config("qwen3-0.6b"))
    r = tune(
        config, "2xrtx4090", seq_len=256, global_batch=4, lora_rank=8, policies=["roundpipe"],
        time_budget_s=5, refine_top=0,
    )  # fmt: skip
    assert r.best.policy == "roundpipe" and r.best.fits


# ------------------------------------------------------------------ command line


def test_simulate_command_prints_one_json_object(capsys, tmp_path):
    from roundpipe.commands.simulate import main

    main(
        ["--model", "qwen3-0.6b", "--hardware", "2xrtx4090", "--policy", "1f1b", "--seq-len", "256",
         "--global-batch", "4", "--lora-rank", "8", "--json", "--trace", str(tmp_path / "t.json")]
    )  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    for key in ("policy", "num_microbatches", "tokens_per_s", "iteration_s", "bubble_fraction",
                "peak_gpu_bytes", "peak_host_bytes", "fits"):  # fmt: skip
        assert key in out
    assert out["policy"] == "1f1b" and out["num_microbatches"] == 4
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_masked_labels_make_the_simulated_step_shorter(capsys):
    from roundpipe.commands.simulate import main

    def step(*extra):
        main(["--model", "qwen3-0.6b", "--hardware", "2xrtx4090", "--seq-len", "512", "--global-batch", "8",
              "--json", *extra])  # fmt: skip
        return json.loads(capsys.readouterr().out)

    every, masked = step(), step("--label-fraction", "0.3")
    assert every["label_fraction"] == 1.0 and masked["label_fraction"] == 0.3
    assert masked["iteration_s"] < every["iteration_s"]


def test_plan_command_tunes_and_finds_the_longest_sequence(capsys):
    from roundpipe.commands.plan import main

    main(["--model", "qwen3-0.6b", "--hardware", "2xrtx4090", "--seq-len", "256", "--global-batch", "4",
          "--lora-rank", "8", "--policies", "roundpipe,gpipe", "--time-budget", "10", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["policy"] in ("roundpipe", "gpipe") and isinstance(out["alternatives"], list)
    main(["--model", "qwen3-0.6b", "--hardware", "1xrtx4090", "--global-batch", "1", "--lora-rank", "8",
          "--max-seq-len", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["max_seq_len"] >= 4096 and out["max_seq_len"] % 128 == 0


def test_commands_exit_2_with_a_message_on_bad_input(capsys):
    from roundpipe.commands.simulate import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "nope", "--seq-len", "128"])
    assert exc.value.code == 2 and "known models" in capsys.readouterr().err


def test_sim_package_never_imports_torch():
    root = pathlib.Path(__file__).resolve().parents[1] / "roundpipe" / "sim"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("torch") for a in node.names), path
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith(("torch", "roundpipe.runtime")), path


def test_a_gradient_download_moves_in_chunk_pieces_that_an_activation_download_passes():
    """As the runtime paces a stage's fp32 gradients down in ``chunk_bytes`` chunks, the model moves
    them in pieces: an activation download that comes due meanwhile goes between two pieces."""
    result = run_scenario(
        Scenario("qwen3-0.6b", "2xrtx4090", seq_len=256, global_batch=4), SimOptions(chunk_bytes=1 << 20)
    )
    spans = [s for s in result.raw_spans if s[1] == "d2h"]
    passed = []
    for dev, name in {(s[0], s[2]) for s in spans if s[3] == "download"}:
        pieces = [s for s in spans if s[0] == dev and s[2] == name]
        first, last = min(s[4] for s in pieces), max(s[5] for s in pieces)
        if any(s[0] == dev and s[3] == "act" and first < s[4] < last for s in spans):
            passed.append(name)
    assert passed, "no activation download went between the pieces of a gradient download"
