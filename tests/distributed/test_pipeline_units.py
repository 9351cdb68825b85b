"""The pipeline's parts without a second process: the layer split, the wire format, the start-up
reports, the watchdog, and rank 0's batch queue (two steps in flight) over a fake runner."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from metalserve.config import ConfigError, EngineConfig, parse_layer_partition
from metalserve.distributed.handshake import RankReport, StartupError, check_reports
from metalserve.distributed.partition import PartitionError, split_layers
from metalserve.distributed.watchdog import Watchdog
from metalserve.distributed.wire import Header, Kind, StepMeta, meta_bytes, pack_payload, split_payload


def test_split_balances_bytes_and_gives_rank0_fewer_layers() -> None:
    assert split_layers([10] * 30, 2, rank0_extra_bytes=80) == [range(0, 11), range(11, 30)]
    assert split_layers([10] * 9, 3) == [range(0, 3), range(3, 6), range(6, 9)]
    # An embedding bigger than a share still leaves rank 0 one layer, and every rank at least one.
    assert split_layers([10] * 3, 3, rank0_extra_bytes=1000) == [range(0, 1), range(1, 2), range(2, 3)]


def test_split_override_and_errors() -> None:
    assert split_layers([1] * 5, 2, override=parse_layer_partition("1,4")) == [range(0, 1), range(1, 5)]
    with pytest.raises(PartitionError, match="sum to the model's 5 layers"):
        split_layers([1] * 5, 2, override=(2, 2))
    with pytest.raises(PartitionError, match="more than the model's 2 layers"):
        split_layers([1] * 2, 3)
    with pytest.raises(ConfigError, match="comma-separated"):
        parse_layer_partition("a,b")
    with pytest.raises(ConfigError, match="gives 3 counts"):
        EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition=(1, 1, 1))


def test_speculation_with_pipeline_stages_is_refused_not_ignored() -> None:
    from metalserve.speculative_config import SpeculativeConfig

    with pytest.raises(ConfigError, match="--speculative-config does not work with --pipeline-parallel-size"):
        EngineConfig(pipeline_parallel_size=2, speculative_config=SpeculativeConfig("ngram", 3, 1, 5))


def test_step_meta_round_trip() -> None:
    rows = [np.array([3, 4, 5]), np.array([9])]
    meta = StepMeta(
        np.arange(5, dtype=np.int32),
        np.arange(10, 15, dtype=np.int32),
        np.array([0, 1, 5], np.int32),
        np.array([17, 4], np.int32),
        rows,
        np.array([0, 4], np.int32),
    )
    flat, width = meta.encode()
    header = Header(Kind.STEP, 5, 2, 2, width, 64, 7, 0)
    assert flat.nbytes == meta_bytes(header)
    back = StepMeta.decode(flat, header)
    assert [r.tolist() for r in back.block_rows] == [[3, 4, 5], [9]]
    assert back.logits_indices.tolist() == [0, 4] and back.seq_lens.tolist() == [17, 4]
    assert back.step_inputs().padded_block_tables().tolist() == [[3, 4, 5], [9, 0, 0]]


def test_step_meta_carries_every_layer_groups_tables() -> None:
    """Group 0's rows, then each other group's (a sliding window's, a recurrent state's), each padded to
    the widest row of any group; the header says how many tables each request has."""
    rows = [np.array([3, 4]), np.array([9])]
    others = ([np.array([7, 8, 11]), np.array([12])], [np.array([20]), np.array([21, 22])])
    meta = StepMeta(
        np.arange(3, dtype=np.int32),
        np.arange(3, dtype=np.int32),
        np.array([0, 1, 3], np.int32),
        np.array([9, 4], np.int32),
        rows,
        np.array([0, 2], np.int32),
        others,
    )
    flat, width = meta.encode()
    header = Header(Kind.STEP, 3, 2, 2, width, 64, 7, 0, 3)
    assert width == 3 and flat.nbytes == meta_bytes(header)
    back = StepMeta.decode(flat, header)
    assert [[r.tolist() for r in g] for g in back.tables()] == [[[3, 4], [9]], [[7, 8, 11], [12]], [[20], [21, 22]]]
    assert back.logits_indices.tolist() == [0, 2]


def test_payload_carries_meta_then_activations() -> None:
    import mlx.core as mx

    flat = np.arange(7, dtype=np.int32)
    hidden = mx.arange(8, dtype=mx.float32).reshape(2, 4)
    payload = pack_payload(flat, hidden)
    assert payload is not None
    header = Header(Kind.STEP, 1, 1, 0, 1, 1, 0, payload.nbytes)  # 2T + (R+1) + 2R + RW + S = 7 ints
    meta, raw = split_payload(payload, header, with_meta=True)
    assert meta is not None and meta.tolist() == list(range(7))
    assert mx.view(raw, mx.float32).tolist() == list(range(8))


def _report(fp: int = 1, layers: range = range(0, 2), ok: bool = True, msg: str = "", bs: int = 16) -> RankReport:
    return RankReport(ok, (fp,) * 8, 100, layers, 5, 1 << 33, msg, bs)


def test_reports_round_trip_and_checks() -> None:
    r = _report(msg="é ok")
    assert RankReport.decode(r.encode().tolist()) == r  # kv bytes above 2**31 survive the int32 words
    check_reports([_report(), _report(layers=range(2, 4))])
    with pytest.raises(StartupError, match="rank 1 could not start: no such file"):
        check_reports([_report(), RankReport.failed("no such file")])
    with pytest.raises(StartupError, match="rank 1 loaded a different model"):
        check_reports([_report(), _report(fp=2, layers=range(2, 4))])
    with pytest.raises(StartupError, match="rank 1 runs --block-size 8, rank 0 16"):
        check_reports([_report(), _report(layers=range(2, 4), bs=8)])
    with pytest.raises(StartupError, match="disagree on the layer split"):
        check_reports([_report(), _report(layers=range(3, 4))])


def test_watchdog_reports_a_dead_rank_and_a_silent_pipeline() -> None:
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    child.wait(30)
    assert Watchdog([child], 60, lambda: None).check() == "pipeline rank 1 exited with status 3"
    since = time.monotonic() - 5
    problem = Watchdog([], 2, lambda: since).check()
    assert problem is not None and "no result from the pipeline for 2 s" in problem
    assert Watchdog([], 60, lambda: since).check() is None
