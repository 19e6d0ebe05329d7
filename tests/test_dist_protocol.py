"""The worker protocol's messages (tier 1): every command and reply survives pickling, and the frequent
ones stay about as small on the wire as the tuples they replaced (class names are one-byte codes)."""

from __future__ import annotations

import pickle

import torch

from rlflow.schedulers.runtime.distributed import protocol as p


def _roundtrip(msg: object) -> object:
    return pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def test_messages_roundtrip() -> None:
    report = p.NodeReport(
        1.0, 2.0, {"values": p.TensorMeta((4, 3), torch.float32, [1, 2, 3, 0]), "texts": p.ListMeta(["a"])}
    )
    sync = p.SyncReport(0.0, 1.0, 8, {2: p.TargetReport("plan", 8, "ab"), 3: p.TargetReport("gather")})
    for msg in (
        p.Stored(1),
        p.GetState(2),
        p.Free(3, [(1, "k", 2)]),
        p.Sync(4, 0, (1, 2), 3),
        p.Fetch(5, 1),
        p.LoadState(6, {"instances": {}}),
        p.Done(7, 1, report),
        p.Done(8, 0, sync),
        p.Failed(9, 1, "node 'x'", "ValueError: bad", "Traceback ..."),
        p.Hello(0),
        p.Ready(1),
        p.Stop(),
        p.DistConfig(threads=2, realloc="gather"),
    ):
        assert _roundtrip(msg) == msg


def test_frequent_messages_are_small() -> None:
    # an acknowledgement: as small as the tuple ("done", cmd, rank, None) was (27 bytes)
    assert len(pickle.dumps(p.Done(3, 1), protocol=pickle.HIGHEST_PROTOCOL)) <= 27
    # a node's times from a rank off the dp leaders: within a few bytes of the tuple with a dict (62)
    assert len(pickle.dumps(p.Done(3, 1, p.NodeReport(1.0, 2.0)), protocol=pickle.HIGHEST_PROTOCOL)) <= 70
