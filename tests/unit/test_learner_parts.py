"""The learner's parts on their own: schedule, tokens, autocast, codec + error feedback, the
latest-wins slots, the parameter bridge, shards, devices and the local checkpoint."""

from __future__ import annotations

import dataclasses
import math
import signal

import numpy as np
import pytest
import torch

from dd_queue.bus.memory import MemoryBus
from dd_queue.clock import FakeClock
from dd_queue.core.codec import CodecSpec, DecodeLimits, decode
from dd_queue.data import Batch, DataSpec, ShardSpec, build_loader
from dd_queue.errors import ConfigError, CorruptPayload
from dd_queue.learner import (
    FragmentParams,
    Identity,
    Inbox,
    InnerLoop,
    Learner,
    LocalCheckpoint,
    Outbox,
    Received,
    RoundBook,
    Snapshot,
    count_tokens,
    lr_factor,
)
from dd_queue.learner.build import resolve_device, shard_for
from dd_queue.learner.inner import autocast_dtype, compile_model
from dd_queue.learner.publisher import ContributionEncoder, corrupt
from dd_queue.learner.service import TwoStageStop
from dd_queue.models import IGNORE_INDEX
from tests.unit.test_learner_standin import (
    StandIn,
    plan_of,
    random_batches,
    tiny_config,
    tiny_model,
)

LIMITS = DecodeLimits()


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


# ── inner loop ──────────────────────────────────────────────────────────────────────────────


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    f = {s: lr_factor(s, warmup_steps=4, decay_steps=10, min_lr_ratio=0.1) for s in range(20)}
    assert [f[s] for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert f[14] == pytest.approx(0.1) and f[19] == pytest.approx(0.1)
    assert all(f[s] >= f[s + 1] for s in range(4, 19))
    assert lr_factor(100, warmup_steps=0, decay_steps=0, min_lr_ratio=0.1) == 1.0


def test_tokens_are_counted_exactly_without_padding():
    targets = torch.tensor([[1, 2, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 5]])
    assert count_tokens(Batch(targets.clone(), targets, n_tokens=6)) == 3
    images = Batch(torch.zeros(5, 1, 8, 8), torch.zeros(5, dtype=torch.int64), n_tokens=5)
    assert count_tokens(images) == 5


def test_autocast_is_bf16_or_fp16_on_cuda_only():
    assert autocast_dtype(torch.device("cuda", 0), "bf16") is torch.bfloat16
    assert autocast_dtype(torch.device("cuda", 0), "fp16") is torch.float16
    assert autocast_dtype(torch.device("cpu"), "bf16") is None
    assert autocast_dtype(torch.device("cpu"), "fp16") is None
    assert autocast_dtype(torch.device("cuda", 0), "off") is None


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_inner_step_trains_with_and_without_autocast(autocast):
    """The bf16 autocast path (CUDA's) runs on CPU too: parameters and AdamW state stay fp32."""
    cfg = tiny_config()
    model = tiny_model(cfg, seed=0)
    inner = InnerLoop(
        model, forward=model, cfg=cfg.learner, device=torch.device("cpu"), autocast=autocast
    )
    batch = next(random_batches(cfg))
    losses = [float(inner.train_step([batch])[0]) for _ in range(6)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert inner.step_count == 6 and inner.lr() == pytest.approx(cfg.learner.inner_lr)


def test_compiled_forward_shares_the_parameters():
    cfg = tiny_config()
    model = tiny_model(cfg, seed=0)
    compiled = compile_model(model, backend="eager")
    batch = next(random_batches(cfg))
    torch.testing.assert_close(compiled(batch).loss, model(batch).loss)
    inner = InnerLoop(model, forward=compiled, cfg=cfg.learner, device=torch.device("cpu"))
    before = model.wte.weight.detach().clone()
    inner.train_step([batch])
    assert not torch.equal(before, model.wte.weight)


# ── contributions ───────────────────────────────────────────────────────────────────────────


def _snapshot(base: np.ndarray, theta: np.ndarray, fragment_id: int = 0) -> Snapshot:
    return Snapshot(
        fragment_id=fragment_id,
        round_id=0,
        base_version=0,
        base=base,
        values=torch.from_numpy(theta.copy()),
        ready=None,
        n_steps=1,
        n_tokens=1,
        step=1,
        taken_at_s=0.0,
    )


def test_fp32_contribution_is_the_exact_outer_gradient():
    rng = np.random.default_rng(0)
    base, theta = rng.standard_normal((2, 1000)).astype(np.float32)
    encoder = ContributionEncoder(CodecSpec("fp32"), error_feedback=True)
    encoded, residual = encoder.encode(_snapshot(base, theta))
    assert residual is None and not encoder.feedback
    np.testing.assert_array_equal(
        decode(encoded.header, encoded.payload, limits=LIMITS), base - theta
    )


def test_error_feedback_carries_the_int4_residual_into_the_next_contribution():
    rng = np.random.default_rng(1)
    base = rng.standard_normal(4096).astype(np.float32)
    encoder = ContributionEncoder(CodecSpec("int4", block_size=64), error_feedback=True)
    sent = np.zeros(4096, np.float64)
    deltas = np.zeros(4096, np.float64)
    for k in range(5):
        theta = base - (rng.standard_normal(4096) * 0.01).astype(np.float32)
        encoded, residual = encoder.encode(_snapshot(base, theta))
        encoder.commit(0, residual)
        sent += decode(encoded.header, encoded.payload, limits=LIMITS)
        deltas += base - theta
        # what was sent plus what is still owed equals every Δ so far (up to fp32 rounding)
        np.testing.assert_allclose(sent + encoder.residual(0), deltas, atol=1e-5 * (k + 1))
    plain = ContributionEncoder(CodecSpec("int4", block_size=64), error_feedback=False)
    assert plain.encode(_snapshot(base, base))[1] is None


def test_corrupt_fault_breaks_the_checksum():
    encoded, _ = ContributionEncoder(CodecSpec("int8"), error_feedback=False).encode(
        _snapshot(np.ones(512, np.float32), np.zeros(512, np.float32))
    )
    with pytest.raises(CorruptPayload):
        decode(encoded.header, corrupt(encoded).payload, limits=LIMITS)


# ── latest-wins slots ───────────────────────────────────────────────────────────────────────


def test_outbox_keeps_the_latest_snapshot_per_fragment_and_pools_buffers():
    made = []

    def new_buffer(p):
        made.append(p)
        return torch.empty(4)

    outbox = Outbox(new_buffer)
    zeros = np.zeros(4, np.float32)
    snaps = []
    for round_id, p in enumerate([0, 1, 0]):
        snap = dataclasses.replace(
            _snapshot(zeros, zeros, p), round_id=round_id, values=outbox.buffer(p)
        )
        snaps.append(snap)
        outbox.put(snap)
    assert outbox.depth() == 2 and outbox.replaced == 1
    first = outbox.take()
    assert (first.fragment_id, first.round_id) == (1, 1)  # fragment 0 went to the back
    assert outbox.restore(first)
    assert [outbox.take().round_id for _ in range(2)] == [2, 1]
    assert outbox.take() is None and outbox.take(block_ms=1) is None
    outbox.done(snaps[2], published=True)
    assert outbox.buffer(0) is snaps[2].values  # recycled, not allocated
    assert made == [0, 1, 0]


def test_inbox_moves_versions_only_forward():
    inbox = Inbox()
    vec = np.zeros(2, np.float32)
    assert inbox.put(Received(fragment_id=0, version=1, round_id=0, values=vec, received_at_s=0))
    assert inbox.put(Received(fragment_id=0, version=3, round_id=0, values=vec, received_at_s=0))
    assert not inbox.put(
        Received(fragment_id=0, version=2, round_id=0, values=vec, received_at_s=0)
    )
    assert inbox.superseded == 1 and inbox.known_version(0) == 3
    [taken] = inbox.take_all()
    assert taken.version == 3 and inbox.held() == {0: 3} and inbox.depth() == 0
    assert not inbox.put(
        Received(fragment_id=0, version=3, round_id=0, values=vec, received_at_s=0)
    )


def test_round_book_requests_only_newer_rounds():
    book = RoundBook()
    assert book.announce(2, 6, request=True)
    assert not book.announce(2, 2, request=True)
    assert book.announce(1, 5, request=False)
    assert book.take_requested() == {2: 6} and book.take_requested() == {}
    assert book.latest(1) == 5 and book.latest(0) is None


def test_round_book_takes_a_lower_round_opened_later_as_a_new_history(caplog):
    """After Redis lost the run, a synchronizer restored from its snapshot reuses round ids
    the learner saw: a lower id opened after the newest starts the fragment's rounds again."""
    book = RoundBook()
    assert book.announce(0, 80, request=True, opened_at_s=100.0)
    assert not book.announce(0, 80, request=True, opened_at_s=100.0)  # a re-read
    assert not book.announce(0, 76, request=True, opened_at_s=99.0)  # older: ignored
    assert book.take_requested() == {0: 80}
    with caplog.at_level("WARNING", logger="dd_queue.learner"):
        assert book.announce(0, 74, request=True, opened_at_s=110.0)  # the new history
    assert "learner.rounds_restarted fragment 0: round 74 opened after round 80" in caplog.text
    assert book.take_requested() == {0: 74} and book.latest(0) == 74
    assert not book.announce(0, 72, request=True, opened_at_s=109.0)  # the lost history's
    assert not book.announce(0, 74, request=True, opened_at_s=110.0)  # a re-read
    assert book.announce(0, 74, request=True, opened_at_s=112.0)  # the same id, later: anew
    assert book.announce(0, 76, request=True, opened_at_s=113.0)  # and on from there
    assert book.announce(1, 9, request=False)  # no time known for the newest:
    assert not book.announce(1, 4, request=False, opened_at_s=200.0)  # a lower id is ignored


# ── parameters, shards, devices ─────────────────────────────────────────────────────────────


def test_fragment_params_write_is_bit_exact_and_mixes_with_alpha():
    cfg = tiny_config()
    model = tiny_model(cfg, seed=0)
    params = FragmentParams(plan_of(cfg, model), model)
    values = np.random.default_rng(0).standard_normal(params.size(1)).astype(np.float32)
    params.write(1, values, alpha=0.0)
    np.testing.assert_array_equal(params.read(1).view(np.uint32), values.view(np.uint32))
    buffer = params.new_buffer(1)
    assert params.copy_out(1, buffer) is None  # CPU: synchronous
    np.testing.assert_array_equal(buffer.numpy(), values)
    params.write(1, np.zeros_like(values), alpha=0.5)
    np.testing.assert_allclose(params.read(1), values * 0.5, rtol=1e-7)
    with pytest.raises(ConfigError, match="another plan"):
        params.write(1, np.zeros(3, np.float32), alpha=0.0)
    other = tiny_model(tiny_config(model={"d_model": 64}), seed=0)
    with pytest.raises(ConfigError, match="do not match the fragment plan"):
        FragmentParams(plan_of(cfg, model), other)


def test_shards_come_from_the_learner_id_and_rank():
    assert shard_for("L3", n_learners=4) == ShardSpec(index=3, count=4, seed=0)
    assert shard_for("L1", n_learners=2, rank=1, world_size=2, seed=5) == ShardSpec(3, 4, 5)
    for bad in ("L4", "learner"):
        with pytest.raises(ConfigError, match="must end in a number"):
            shard_for(bad, n_learners=4)


def test_device_auto_is_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda")


# ── local checkpoint ────────────────────────────────────────────────────────────────────────


def test_checkpoint_refuses_another_learners_file_and_damaged_files(tmp_path):
    ckpt = LocalCheckpoint(tmp_path, run_id="r", learner_id="L0", rank=0)
    assert ckpt.load() is None
    ckpt.save({"x": torch.ones(2)})
    assert torch.equal(ckpt.load()["x"], torch.ones(2))
    other = LocalCheckpoint(tmp_path, run_id="r", learner_id="L1", rank=0)
    other.path.parent.mkdir(parents=True, exist_ok=True)
    other.path.write_bytes(ckpt.path.read_bytes())
    with pytest.raises(ConfigError, match="belongs to run 'r' learner 'L0'"):
        other.load()
    ckpt.path.write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="delete it"):
        ckpt.load()


def test_restarted_learner_resumes_optimizer_state_and_data_position(tmp_path):
    cfg = tiny_config(learner={"checkpoint_dir": str(tmp_path), "checkpoint_every_steps": 2})
    clock = FakeClock(10.0)
    bus = MemoryBus("tl", clock=clock)
    model = tiny_model(cfg, seed=7)
    StandIn(bus, plan_of(cfg, model)).publish_model(model)

    def start(pid: int) -> Learner:
        loader = build_loader(
            DataSpec(batch_size=2, max_bytes=1 << 16), seq_len=16, shard=ShardSpec(0, 2, 0)
        )
        learner = Learner(
            cfg,
            learner_id="L0",
            model=tiny_model(cfg, seed=1),
            loader=loader,
            bus=bus,
            clock=clock,
            identity=Identity("L0", "h", pid),
            checkpoint=LocalCheckpoint(tmp_path, run_id="tl", learner_id="L0", rank=0),
        )
        learner.join()
        return learner

    first = start(1)
    for _ in range(4):
        first.step()
    saved = first.inner.optimizer.state_dict()
    position = first.loader.state_dict()  # type: ignore[attr-defined]
    first.leave()
    second = start(2)
    assert second.step_count == 4 and second.loader.state_dict() == position  # type: ignore[attr-defined]
    resumed = second.inner.optimizer.state_dict()
    for key, state in saved["state"].items():
        torch.testing.assert_close(resumed["state"][key]["exp_avg"], state["exp_avg"])
    assert all(c.steps == 0 for c in second.counters)  # counters always restart at 0


def test_ddq_has_a_learner_command(capsys):
    from dd_queue.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["learner", "--help"])
    assert exit_info.value.code == 0
    assert "--learner-id" in capsys.readouterr().out


def test_first_signal_asks_to_stop():
    stop = TwoStageStop()
    assert not stop.requested
    stop._handle(signal.SIGTERM, None)
    assert stop.requested and stop.signals == 1
