"""The local-disk KV tier (services/engine/kv_disk.py): files per block hash that round-trip bit-exact, a byte bound
with the oldest out first, a corrupt or short file that is a miss (and deleted), a directory whose manifest does
not match that is wiped, one worker per directory. Then on the real demo model (SmolLM2-135M) in one engine: a
prefix evicted from a tiny pool goes to disk and comes back bit-exact with the cold run's continuation, also in a
new engine on the same directory (a restart), and a block the host tier pushes out goes on to disk."""

from __future__ import annotations

import errno
import json
import logging
import math
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.engine import kv_codec
from services.engine.block_hash import block_hashes
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.kv_disk import DiskKvTier
from services.engine.kv_tier import encode_block, encoded_block_bytes, host_copy
from services.engine.loader import LoadedModel
from services.engine.nvfp4.recipe import NVFP4Tensor
from services.engine.sampling import SamplingParams

SHAPE = (2, 2, 3, 16, 64)  # layers, K/V, kv heads, block size, head dim
FP = "f" * 32


def tier(
    path: Path, capacity: int = 64 << 20, codec: str = "bf16", fingerprint: str = FP, **kw
) -> DiskKvTier:
    return DiskKvTier(
        path, capacity, codec, kw.get("shape", SHAPE), kw.get("dtype", torch.bfloat16), fingerprint, 16
    )


def block(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def files(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "blocks").iterdir())


def test_a_bf16_block_round_trips_bit_exact_through_its_file(tmp_path: Path) -> None:
    t = tier(tmp_path)
    b = block(1)
    assert t.put(11, 7, b) == []
    assert files(tmp_path) == [f"{11:016x}.kv"]
    assert 11 in t and t.lookup([11, 12]) == 1  # the next hash is not here: the run stops
    e = t.take(11)
    assert e.parent_hash == 7 and e.tier == "disk"
    assert isinstance(e.data, torch.Tensor) and e.data.dtype == torch.bfloat16
    assert torch.equal(e.data.view(torch.int16), b.view(torch.int16))  # the same bits
    assert 11 not in t and files(tmp_path) == [] and t.used_bytes == 0  # one tier at a time: taken = gone


@pytest.mark.parametrize("codec", ["fp8", "nvfp4"])
def test_a_compressed_block_keeps_its_codes_and_scales_on_disk(tmp_path: Path, codec: str) -> None:
    t = tier(tmp_path, codec=codec)
    b = block(2)
    enc = encode_block(codec, b, host_copy)
    t.put(5, 0, enc)
    got = t.take(5).data
    if codec == "fp8":
        assert isinstance(got, tuple) and isinstance(enc, tuple)
        assert torch.equal(got[0], enc[0]) and torch.equal(got[1].view(torch.uint8), enc[1].view(torch.uint8))
        restored = kv_codec.fp8_decode(got[0], got[1], torch.bfloat16)
        assert torch.equal(restored, kv_codec.fp8_decode(enc[0], enc[1], torch.bfloat16))
    else:
        assert isinstance(got, NVFP4Tensor) and isinstance(enc, NVFP4Tensor)
        assert torch.equal(got.packed, enc.packed) and torch.equal(got.scales, enc.scales)
        assert torch.equal(got.global_scale, enc.global_scale) and got.shape == enc.shape
        restored = kv_codec.nvfp4_decode(got, torch.bfloat16)
        assert torch.equal(restored, kv_codec.nvfp4_decode(enc, torch.bfloat16))


def test_the_byte_bound_holds_and_the_oldest_block_goes_first(tmp_path: Path) -> None:
    probe = tier(tmp_path / "probe")
    probe.put(1, 0, block(0))
    size = probe.used_bytes  # one block file, header included
    assert size > encoded_block_bytes("bf16", SHAPE, torch.bfloat16)
    t = tier(tmp_path / "t", capacity=3 * size + size // 2)
    dropped = []
    for h in range(1, 6):
        dropped += t.put(h, h - 1, block(h))
    assert dropped == [(1, 0), (2, 1)]  # oldest first, with their parents
    assert t.hashes() == [3, 4, 5] and t.used_bytes == 3 * size <= t.capacity_bytes
    assert files(tmp_path / "t") == [f"{h:016x}.kv" for h in (3, 4, 5)]
    assert sum(p.stat().st_size for p in (tmp_path / "t" / "blocks").iterdir()) == t.used_bytes


def test_a_bound_below_one_block_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_disk_bytes=1000 cannot hold one KV block"):
        tier(tmp_path, capacity=1000)


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "empty", "another block's file"])
def test_a_corrupt_or_short_file_is_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    t = tier(tmp_path)
    t.put(1, 0, block(1))
    t.put(2, 1, block(2))
    p = tmp_path / "blocks" / f"{2:016x}.kv"
    raw = bytearray(p.read_bytes())
    if damage == "flip a payload byte":
        raw[-100] ^= 0x40
    elif damage == "truncate":
        raw = raw[: len(raw) - 10]
    elif damage == "empty":
        raw = bytearray()
    else:
        raw = bytearray((tmp_path / "blocks" / f"{1:016x}.kv").read_bytes())  # right shape, wrong hash
    p.write_bytes(bytes(raw))
    assert t.lookup([1, 2]) == 1  # block 1 still restores; 2 is a miss
    assert 2 not in t and not p.exists() and t.corrupt == 1
    with pytest.raises(KeyError):
        t.take(2)
    assert torch.equal(t.take(1).data, block(1))  # type: ignore[arg-type]


def rewrite_header(path: Path, edit: Callable[[dict], object]) -> None:
    """Replace a block file's JSON header by edit(header), keeping its payload."""
    raw = path.read_bytes()
    magic, hlen = struct.unpack("<8sI", raw[:12])
    header = json.loads(raw[12 : 12 + hlen])
    new = json.dumps(edit(header)).encode()
    path.write_bytes(struct.pack("<8sI", magic, len(new)) + new + raw[12 + hlen :])


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: [h],
        lambda h: {k: v for k, v in h.items() if k != "parent"},
        lambda h: {k: v for k, v in h.items() if k != "payload_bytes"},
        lambda h: {**h, "parent": "7"},
        lambda h: {**h, "parts": [[p[0], [math.prod(p[1])]] for p in h["parts"]]},  # the same bytes, flat
    ],
    ids=["not an object", "no parent", "no payload length", "a parent that is no number", "other parts"],
)
def test_a_malformed_header_is_a_miss_when_read_and_at_start_up_never_an_exception(
    tmp_path: Path, edit: Callable[[dict], object]
) -> None:
    t = tier(tmp_path)
    t.put(1, 0, block(1))
    t.put(2, 1, block(2))
    rewrite_header(tmp_path / "blocks" / f"{2:016x}.kv", edit)
    assert t.lookup([1, 2]) == 1 and 2 not in t and t.corrupt == 1
    t.put(2, 1, block(2))
    t.close()
    rewrite_header(tmp_path / "blocks" / f"{2:016x}.kv", edit)
    again = tier(tmp_path)  # indexing at start-up drops it
    assert again.hashes() == [1] and again.corrupt == 1 and files(tmp_path) == [f"{1:016x}.kv"]


def test_a_block_another_model_wrote_is_a_miss_even_in_a_matching_directory(tmp_path: Path) -> None:
    """A block file carries the model and block size it was computed with: one copied from another model's
    directory (same layout, same hash name) is never restored as this model's KV."""
    other = tier(tmp_path / "other", fingerprint="0" * 32)
    other.put(5, 0, block(5))
    other.close()
    mine = tier(tmp_path / "mine")
    mine.put(4, 0, block(4))
    mine.close()
    name = f"{5:016x}.kv"
    (tmp_path / "mine" / "blocks" / name).write_bytes((tmp_path / "other" / "blocks" / name).read_bytes())
    again = tier(tmp_path / "mine")
    assert again.hashes() == [4] and again.corrupt == 1 and again.lookup([5]) == 0


def test_a_directory_that_refuses_deletions_never_fails_the_caller_and_stops_the_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read-only remount or lost permissions: each call that deletes a file (evicting the oldest, a restore's
    take, a rewrite) goes on; the tier stops writing, and says so once."""
    probe = tier(tmp_path / "probe")
    probe.put(1, 0, block(0))
    size = probe.used_bytes
    t = tier(tmp_path / "t", capacity=2 * size)
    t.put(1, 0, block(1))
    t.put(2, 1, block(2))

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    with caplog.at_level(logging.WARNING, logger="rackserve.engine.kv_disk"):
        assert t.put(3, 2, block(3)) == [(1, 0)]  # evicting 1 could not delete its file: no exception
        assert t.lookup([2]) == 1 and torch.equal(t.take(2).data, block(2))  # type: ignore[arg-type]
        assert not t.writable and 3 not in t
        assert t.put(4, 3, block(4)) == [] and 4 not in t  # no more writes
    assert len([r for r in caplog.records if "refuses changes" in r.message]) == 1
    assert t.used_bytes == 0 and len(t) == 0  # the index counts only what it still offers


def test_a_directory_that_refuses_writes_stops_the_writes_and_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read-only remount refuses the writes themselves; a full disk (ENOSPC) may pass and is only logged."""
    t = tier(tmp_path)
    t.put(1, 0, block(1))

    def refuse(path: Path, header: bytes, payload: bytes) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(DiskKvTier, "_write", staticmethod(refuse))
    with caplog.at_level(logging.WARNING, logger="rackserve.engine.kv_disk"):
        for h in (2, 3, 4):
            t.put(h, h - 1, block(h))
    assert not t.writable and t.hashes() == [1]
    assert len([r for r in caplog.records if "refuses changes" in r.message]) == 1
    assert torch.equal(t.take(1).data, block(1))  # type: ignore[arg-type]  # what it holds still restores


def test_a_volume_smaller_than_the_bound_keeps_the_newest_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that fills up before `--kv-disk-bytes` does (a smaller volume, other files on it): until
    2026-12-08 the tier kept the blocks it wrote first and lost every newer one (ENOSPC, logged), for good; now
    the oldest make room, as for the bound, and every block ends up in a file."""
    real = DiskKvTier._write

    def small_volume(path: Path, header: bytes, payload: bytes) -> None:
        if len(files(tmp_path)) >= 2:  # room for two block files
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, header, payload)

    monkeypatch.setattr(DiskKvTier, "_write", staticmethod(small_volume))
    t = tier(tmp_path)
    dropped = []
    for h in (1, 2, 3, 4, 5):
        dropped += t.put(h, h - 1, block(h))
    assert t.writable and t.hashes() == [4, 5] and dropped == [(1, 0), (2, 1), (3, 2)]
    assert files(tmp_path) == [f"{4:016x}.kv", f"{5:016x}.kv"]
    assert t.used_bytes == sum(p.stat().st_size for p in (tmp_path / "blocks").iterdir())
    assert torch.equal(t.take(5).data, block(5))  # type: ignore[arg-type]


def test_the_blocks_directory_removed_under_a_running_tier_is_made_again(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.put(1, 0, block(1))
    shutil.rmtree(tmp_path / "blocks")
    t.put(2, 1, block(2))
    assert 2 in t and files(tmp_path) == [f"{2:016x}.kv"]
    assert t.lookup([1]) == 0 and 1 not in t  # its file went with the directory: a miss, forgotten


def test_a_directory_under_a_block_name_is_a_miss_and_the_tier_keeps_writing(tmp_path: Path) -> None:
    """A directory where a block file should be cannot be deleted like a file: until 2026-12-08 that failed
    deletion turned the tier's writes off, when read and at every start-up after, so no block reached the disk
    again on that worker."""
    t = tier(tmp_path)
    t.put(1, 0, block(1))
    t.put(2, 1, block(2))
    name = tmp_path / "blocks" / f"{1:016x}.kv"
    name.unlink()
    name.mkdir()
    assert t.lookup([1, 2]) == 0 and 1 not in t  # a miss, forgotten
    t.put(3, 2, block(3))
    assert t.writable and 3 in t and t.lookup([2, 3]) == 2
    t.close()
    t = tier(tmp_path)  # a restart on the same directory: dropped at start-up, the tier still writes
    assert 1 not in t and 2 in t and 3 in t
    t.put(4, 3, block(4))
    assert t.writable and 4 in t and t.lookup([4]) == 1
    t.close()


def test_a_restart_with_the_same_manifest_keeps_the_blocks(tmp_path: Path) -> None:
    t = tier(tmp_path)
    for h in (1, 2, 3):
        t.put(h, h - 1, block(h))
    used = t.used_bytes
    t.close()
    (tmp_path / "blocks" / f".{9:016x}.123.tmp").write_bytes(b"half a write")  # a crash mid-write
    again = tier(tmp_path)
    assert again.hashes() == [1, 2, 3] and again.used_bytes == used
    assert again.parent_of(3) == 2
    assert files(tmp_path) == [f"{h:016x}.kv" for h in (1, 2, 3)]  # the stray temporary file is gone
    assert again.lookup([1, 2, 3]) == 3 and torch.equal(again.take(3).data, block(3))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"fingerprint": "0" * 32}, "model_fingerprint"),
        ({"codec": "fp8"}, "codec"),
        ({"dtype": torch.float32}, "dtype"),
        ({"shape": (2, 2, 3, 32, 64)}, "block_shape"),
    ],
)
def test_a_directory_of_another_model_or_layout_is_wiped_with_the_reason_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict, named: str
) -> None:
    t = tier(tmp_path)
    t.put(1, 0, block(1))
    t.put(2, 1, block(2))
    t.close()
    with caplog.at_level(logging.WARNING, logger="rackserve.engine.kv_disk"):
        other = tier(tmp_path, **change)
    assert len(other) == 0 and files(tmp_path) == [] and other.lookup([1, 2]) == 0
    assert any("wiping 2 blocks" in r.message and named in r.message for r in caplog.records), caplog.text
    other.close()
    assert len(tier(tmp_path, **change)) == 0  # the manifest now describes the new model


def test_a_restart_with_a_smaller_bound_keeps_the_newest_blocks(tmp_path: Path) -> None:
    t = tier(tmp_path)
    for h in (1, 2, 3, 4):
        t.put(h, h - 1, block(h))
    size = t.used_bytes // 4
    t.close()
    small = tier(tmp_path, capacity=2 * size)
    assert small.hashes() == [3, 4] and files(tmp_path) == [f"{h:016x}.kv" for h in (3, 4)]


def test_two_tiers_cannot_share_a_directory(tmp_path: Path) -> None:
    tier(tmp_path)
    with pytest.raises(ValueError, match="in use by another process"):
        tier(tmp_path)


def test_bad_disk_settings_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_disk_bytes must be >= 0"):
        EngineConfig(kv_disk_path=str(tmp_path), kv_disk_bytes=-1)
    with pytest.raises(ValueError, match="kv_disk_bytes needs kv_disk_path"):
        EngineConfig(kv_disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_disk_path needs kv_disk_bytes"):
        EngineConfig(kv_disk_path=str(tmp_path))
    with pytest.raises(ValueError, match="needs the prefix cache"):
        EngineConfig(kv_disk_path=str(tmp_path), kv_disk_bytes=1 << 20, enable_prefix_caching=False)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="kv_disk_path=.*cannot be used"):
        tier(tmp_path / "a-file")


# ---------------------------------------------------------------------------------------------- in a real engine
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BS = 16
POOL = 7
TEXT_A = (
    "The history of the lighthouse keepers of the northern coast is a story of patience. Every night for two "
    "hundred years a keeper climbed the stairs, trimmed the wick and watched the sea. Their logbooks record "
    "storms, wrecks, rescues and the slow arrival of electricity. When the last keeper left in the nineteen "
    "eighties, the light went on by itself, and the logbooks went to the museum in town. Summarize what the "
    "keepers did each night:"
)
TEXT_B = (
    "A recipe for bread needs flour, water, salt and yeast. Mix them, knead the dough for ten minutes, let it "
    "rise until it doubles, shape it, let it rise again and bake it in a hot oven until the crust is brown and "
    "it sounds hollow when tapped. Bakers have argued for centuries about hydration, about the temperature of "
    "the water and about how long the dough should rest. Explain why the dough must rest twice before baking:"
)


def make(smollm2: LoadedModel, **kw) -> LLMEngine:
    cfg = dict(dtype="bfloat16", block_size=BS, num_kv_blocks=POOL, max_num_batched_tokens=256)
    cfg.update(kw)
    return LLMEngine(smollm2, EngineConfig(**cfg))


@pytest.fixture(scope="module")
def prompts(smollm2: LoadedModel) -> tuple[list[int], list[int]]:
    tok = make(smollm2).tokenizer
    a, b = tok.encode(TEXT_A), tok.encode(TEXT_B)  # type: ignore[attr-defined]
    assert 4 * BS < len(a) and -(-(len(b) + GREEDY.max_tokens - 1) // BS) == POOL  # b alone evicts all of a
    return a, b


@pytest.fixture(scope="module")
def cold(smollm2: LoadedModel, prompts: tuple[list[int], list[int]]) -> list[int]:
    return make(smollm2).generate([prompts[0]], GREEDY)[0]


def again(e: LLMEngine, a: list[int]) -> tuple[list[int], int]:
    e.add_request("again", a, GREEDY)
    out: list[int] = []
    cached = -1
    while e.has_unfinished():
        for o in e.step():
            out += o.new_token_ids
            cached = o.num_cached_tokens
    return out, cached


def test_an_evicted_prefix_comes_back_from_disk_bit_exact_and_after_a_restart(
    smollm2: LoadedModel, prompts: tuple[list[int], list[int]], cold: list[int], tmp_path: Path
) -> None:
    a, b = prompts
    e = make(smollm2, kv_disk_path=str(tmp_path), kv_disk_bytes=64 << 20)  # tier 2 off: pool -> disk
    assert e.tier2 is None and e.disk is not None
    e.generate([a], GREEDY)
    hashes = block_hashes(a[: len(a) - 1], BS)
    original = e.kv.read_blocks(torch.tensor(e.blocks.lookup_prefix(hashes))).clone()
    e.generate([b], GREEDY)
    assert e.blocks.lookup_prefix(hashes) == [] and all(h in e.disk for h in hashes)
    events = e.drain_kv_events()
    assert set(hashes) <= {ev.block_hash for ev in events if ev.kind == "offloaded" and ev.tier == "disk"}
    assert not [ev for ev in events if ev.tier == "host" and ev.kind in ("offloaded", "dropped")]

    out, cached = again(e, a)
    assert cached == len(hashes) * BS and out == cold
    assert torch.equal(e.kv.read_blocks(torch.tensor(e.blocks.lookup_prefix(hashes))), original)  # bit-exact
    st = e.stats().disk
    assert st is not None and st.hits == len(hashes) and st.restores == 1
    assert [
        ev.block_hash for ev in e.drain_kv_events() if ev.kind == "restored" and ev.tier == "disk"
    ] == hashes
    assert not any(h in e.disk for h in hashes)  # one tier at a time

    e.generate([b], GREEDY)  # out to disk again, then the "worker" goes away
    assert all(h in e.disk for h in hashes)
    e.disk.close()
    del e
    fresh = make(smollm2, kv_disk_path=str(tmp_path), kv_disk_bytes=64 << 20)
    assert fresh.disk is not None and set(hashes) <= set(fresh.blocks.disk_hashes())
    out, cached = again(fresh, a)
    assert cached == len(hashes) * BS and out == cold  # a real hit, the same chain, the cold run's tokens
    fresh.disk.close()

    f32 = make(smollm2, dtype="float32", kv_disk_path=str(tmp_path), kv_disk_bytes=64 << 20)
    assert f32.disk is not None and len(f32.disk) == 0  # another dtype: the directory was wiped
    out, cached = again(f32, a)
    assert cached == 0
    f32.disk.close()


def test_blocks_the_host_tier_pushes_out_go_on_to_disk(
    smollm2: LoadedModel, prompts: tuple[list[int], list[int]], cold: list[int], tmp_path: Path
) -> None:
    a, b = prompts
    mc = smollm2.config
    per_block = encoded_block_bytes(
        "bf16", (mc.num_layers, 2, mc.num_kv_heads, BS, mc.head_dim), torch.bfloat16
    )
    e = make(smollm2, kv_tier2_bytes=2 * per_block, kv_disk_path=str(tmp_path), kv_disk_bytes=64 << 20)
    assert e.tier2 is not None and e.disk is not None
    e.generate([a], GREEDY)
    e.generate([b], GREEDY)
    hashes = block_hashes(a[: len(a) - 1], BS)
    events = e.drain_kv_events()
    to_disk = [ev.block_hash for ev in events if ev.kind == "offloaded" and ev.tier == "disk"]
    host_dropped = [ev.block_hash for ev in events if ev.kind == "dropped" and ev.tier == "host"]
    assert to_disk and to_disk == host_dropped  # every block host memory let go went to disk
    for h in to_disk:  # DROPPED (host) comes before OFFLOADED (disk)
        kinds = [(ev.kind, ev.tier) for ev in events if ev.block_hash == h]
        assert kinds.index(("dropped", "host")) < kinds.index(("offloaded", "disk"))
    assert len(e.tier2) == 2 and all((h in e.tier2) != (h in e.disk) for h in hashes)  # one tier each
    out, cached = again(e, a)  # the run continues pool -> host -> disk
    assert cached == len(hashes) * BS and out == cold
    st = e.stats()
    assert st.tier2 is not None and st.disk is not None
    assert st.tier2.hits + st.disk.hits == len(hashes) and st.disk.hits > 0
    e.disk.close()


def test_a_disk_that_refuses_deletions_costs_the_engine_no_request_and_no_pool_block(
    smollm2: LoadedModel,
    prompts: tuple[list[int], list[int]],
    cold: list[int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The disk tier full, then its directory refuses deletions (permissions changed under a running worker):
    until 2026-12-07 the eviction inside a pool allocation raised, the step failed, and the blocks taken for it
    were lost to the pool for good, so later prompts waited forever."""
    a, b = prompts
    mc = smollm2.config
    per_block = encoded_block_bytes(
        "bf16", (mc.num_layers, 2, mc.num_kv_heads, BS, mc.head_dim), torch.bfloat16
    )
    e = make(smollm2, kv_disk_path=str(tmp_path), kv_disk_bytes=3 * (per_block + 1024))
    e.generate([a], GREEDY)
    e.generate([b], GREEDY)  # the disk tier at its bound
    assert e.disk is not None and len(e.disk) == 3

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    for _ in range(2):
        out, _ = again(e, a)
        assert out == cold
        e.generate([b], GREEDY)
    assert not e.disk.writable
    assert e.blocks.num_free == POOL  # nothing running: every pool block is free again
    e.disk.close()


def test_a_block_file_found_damaged_when_read_is_reported_dropped_to_the_router(
    smollm2: LoadedModel, prompts: tuple[list[int], list[int]], cold: list[int], tmp_path: Path
) -> None:
    """A file damaged under a running worker is a miss when a prompt's lookup reads it, and deleted: until
    2026-12-08 without an event, so the router went on counting the block as this worker's disk block. Here the
    prompt that read it waits for pool blocks and is cancelled, so nothing recomputes the block: the router's view
    and the worker's tier must still agree."""
    from services.router.prefix_index import DISK, PrefixIndex

    a, b = prompts
    e = make(smollm2, kv_disk_path=str(tmp_path), kv_disk_bytes=64 << 20)
    assert e.disk is not None
    index = PrefixIndex()

    def follow() -> None:
        for ev in e.drain_kv_events():
            if ev.kind == "stored":
                index.stored("w", [ev.block_hash])
            elif ev.kind == "evicted":
                index.evicted("w", [ev.block_hash])
            elif ev.kind == "offloaded":
                index.offloaded("w", [ev.block_hash], ev.tier)
            elif ev.kind == "restored":
                index.restored("w", [ev.block_hash], ev.tier)
            else:
                index.tier2_dropped("w", [ev.block_hash], ev.tier)

    e.generate([a], GREEDY)
    e.generate([b], GREEDY)  # a on disk, b in the whole pool
    follow()
    hashes = block_hashes(a[: len(a) - 1], BS)
    assert all(h in e.disk for h in hashes) and index.tier2_blocks_of("w", DISK) == len(e.disk)
    path = tmp_path / "blocks" / f"{hashes[0]:016x}.kv"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one payload byte
    path.write_bytes(bytes(data))

    e.add_request("b2", b, GREEDY)  # takes every pool block
    e.add_request("a2", a, GREEDY)  # looked up (its first file read and found damaged), then waits for blocks
    e.step()
    assert hashes[0] not in e.disk and not path.exists()
    e.abort("a2")  # the client gave up
    while e.has_unfinished():
        e.step()
    follow()
    assert index.tier2_blocks_of("w", DISK) == len(e.disk)
    assert index.tiered_overlaps(hashes).get("w", (0, 0)) == (
        0,
        0,
    )  # nothing of a's chain restorable from block 0
    out, cached = again(e, a)
    assert cached == 0 and out == cold  # recomputed, never served
    e.disk.close()
