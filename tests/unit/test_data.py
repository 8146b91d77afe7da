"""Data: sources, determinism across world sizes, disjoint dp shards, exact resume, tokenized files."""

import numpy as np
import pytest
import torch

from meshforge.cli import main
from meshforge.config.schema import DataConfig
from meshforge.data import DataError, ShardedBatchLoader, build_source
from meshforge.data.sources import stdlib_sources


@pytest.fixture(scope="module")
def text_source():
    return build_source(DataConfig(source="text", max_files=3), seq_len=32, vocab_size=256, seed=0)


def global_batch(source, k, dp, m, G=8, seed=5):
    """Reassemble global batch k from every dp rank's micro batches."""
    seqs = []
    for r in range(dp):
        ld = ShardedBatchLoader(source, G, m, dp_rank=r, dp_size=dp, seed=seed)
        ld.load_state_dict({"step": k})
        mine = torch.cat([x for x, _ in ld.next_batch()])
        seqs.append(mine)
    return torch.cat(seqs)


def test_default_text_is_the_stdlib():
    files = stdlib_sources()
    assert len(files) > 50 and any(f.name == "os.py" for f in files)


def test_labels_are_inputs_shifted(text_source):
    (x, y), = ShardedBatchLoader(text_source, 2, 2).next_batch()
    assert x.shape == (2, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("dp, m", [(2, 1), (2, 4), (4, 2), (8, 1)])
def test_global_batch_is_the_same_whatever_world_and_micro_batch(text_source, dp, m):
    for k in (0, 3):
        assert torch.equal(global_batch(text_source, k, 1, 8), global_batch(text_source, k, dp, m))


def test_dp_ranks_take_disjoint_slices(text_source):
    idx = ShardedBatchLoader(text_source, 8, 1).global_batch_indices(0)
    assert len(set(idx)) == 8
    got = []
    for r in range(4):
        ld = ShardedBatchLoader(text_source, 8, 1, dp_rank=r, dp_size=4)
        got.append({tuple(x[0].tolist()) for x, _ in ld.next_batch()})
    for i in range(4):
        for j in range(i + 1, 4):
            assert not (got[i] & got[j])


def test_exact_resume(text_source):
    a = ShardedBatchLoader(text_source, 4, 2, seed=9)
    for _ in range(3):
        a.next_batch()
    state = a.state_dict()
    want = a.next_batch()
    b = ShardedBatchLoader(text_source, 4, 2, seed=9)
    b.load_state_dict(state)
    got = b.next_batch()
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(want, got))
    with pytest.raises(ValueError, match="seed"):
        ShardedBatchLoader(text_source, 4, 2, seed=10).load_state_dict(state)


def test_epochs_reshuffle_and_seed_matters(text_source):
    n = text_source.num_samples
    ld = ShardedBatchLoader(text_source, 1, 1, seed=1)
    e0 = [ld._index(i) for i in range(n)]
    e1 = [ld._index(n + i) for i in range(n)]
    assert sorted(e0) == sorted(e1) == list(range(n)) and e0 != e1
    assert ShardedBatchLoader(text_source, 1, 1, seed=2)._index(0) != e0[0] or \
        ShardedBatchLoader(text_source, 1, 1, seed=2)._index(1) != e0[1]


def test_synthetic_is_pure_function_of_seed_and_index():
    s1, s2 = build_source(DataConfig(source="synthetic"), 16, 100, 3), build_source(DataConfig(source="synthetic"), 16, 100, 3)
    assert np.array_equal(s1.sample(12345), s2.sample(12345)) and s1.sample(0).max() < 100


def test_prepare_and_tokenized_source(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("hello meshforge " * 50)
    out = tmp_path / "tok.npy"
    assert main(["data", "prepare", str(src), "-o", str(out), "--dtype", "uint32"]) == 0
    arr = np.load(out)
    assert arr.dtype == np.uint32 and bytes(arr[:5].astype(np.uint8)) == b"hello"
    s = build_source(DataConfig(source="tokenized", path=str(out)), 16, 256, 0)
    assert s.sample(0)[0] == ord("h")


def test_bad_data_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(DataError, match="matches no file"):
        build_source(DataConfig(source="text", paths=[str(tmp_path / "nope*.txt")]), 16, 256, 0)
    bad = tmp_path / "f.npy"
    np.save(bad, np.zeros(100, dtype=np.float32))
    with pytest.raises(DataError, match="expected a 1-D uint16 or uint32"):
        build_source(DataConfig(source="tokenized", path=str(bad)), 16, 256, 0)
    big = tmp_path / "big.npy"
    np.save(big, np.full(100, 300, dtype=np.uint16))
    with pytest.raises(DataError, match="outside model.vocab_size=256"):
        build_source(DataConfig(source="tokenized", path=str(big)), 16, 256, 0)
    short = tmp_path / "s.txt"
    short.write_text("hi")
    with pytest.raises(DataError, match="fewer than one sequence"):
        build_source(DataConfig(source="text", paths=[str(short)]), 16, 256, 0)


def _same_batches(a, b) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(torch.equal(s, t) for ms, mt in zip(x, y)
                                                             for s, t in zip(ms, mt)) for x, y in zip(a, b))


def test_background_workers_build_the_same_batches_and_resume_exactly(tmp_path):
    from meshforge.data.sources import TokenStreamSource
    from meshforge.data.workers import BackgroundLoader

    src = TokenStreamSource(np.arange(32 * 20 + 1) % 256, 32, "counting")  # 20 samples: an epoch is 2.5 batches

    def plain():
        return ShardedBatchLoader(src, 8, 2, dp_rank=1, dp_size=2, seed=3)

    ref = plain()
    want = [ref.next_batch() for _ in range(8)]
    bg = BackgroundLoader(plain(), num_workers=2, prefetch_factor=2)
    got = [bg.next_batch() for _ in range(3)]  # mid epoch 1, with batches 3.. already prefetched
    torch.save(bg.state_dict(), tmp_path / "state.pt")
    bg.close()
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # as the checkpoint reads it
    assert state["step"] == 3 and state["workers"]["num_workers"] == 2
    for resumed in (BackgroundLoader(plain(), 2, 2), BackgroundLoader(plain(), 1, 3), plain()):
        resumed.load_state_dict(state)  # same workers: the StatefulDataLoader state; others: restart at step 3
        assert _same_batches(got + [resumed.next_batch() for _ in range(5)], want)
        resumed.close()
    from_plain = BackgroundLoader(plain(), 2, 2)
    from_plain.load_state_dict(ref.state_dict())  # a checkpoint of a run without workers
    assert from_plain.step == 8 and _same_batches([from_plain.next_batch()], [ref.next_batch()])
    from_plain.close()
    state["workers"]["dataloader"]["_snapshot"]["_main_snapshot"]["_sampler_iter_state"]["next"] = 4
    wrong = BackgroundLoader(plain(), 2, 2)
    wrong.load_state_dict(state)  # a worker state that disagrees with the consumed count is never trained on
    with pytest.raises(RuntimeError, match="returned global batch 4, expected 3"):
        wrong.next_batch()
    wrong.close()


def test_worker_keys():
    from meshforge.config import ConfigError, load_config

    assert load_config(None, ["data.num_workers=2", "data.prefetch_factor=4"], world_size=1).data.num_workers == 2
    with pytest.raises(ConfigError, match="data.prefetch_factor=4 is only read with data.num_workers > 0"):
        load_config(None, ["data.prefetch_factor=4"], world_size=1)


@pytest.fixture(scope="module")
def stream_files(tmp_path_factory):
    """Two jsonl files of texts from 3 to 60 bytes: windows of 17 span records and records span windows."""
    import json

    d = tmp_path_factory.mktemp("stream")
    rng = np.random.default_rng(0)
    for name, n in (("a.jsonl", 23), ("b.jsonl", 17)):
        with open(d / name, "w") as f:
            for i in range(n):
                f.write(json.dumps({"text": f"{name}{i}:" + "xyz"[i % 3] * int(rng.integers(0, 55))}) + "\n")
    return [str(d / "a.jsonl"), str(d / "b.jsonl")]


def _stream_cfg(files, streaming=True):
    return DataConfig(source="dataset", paths=files, streaming=streaming)


def test_streaming_reads_the_in_memory_windows_in_order_at_any_world_size(stream_files):
    from meshforge.data import batch_loader

    memory = build_source(_stream_cfg(stream_files, False), seq_len=16, vocab_size=256, seed=0)
    stream = build_source(_stream_cfg(stream_files), seq_len=16, vocab_size=256, seed=0)
    n_batches = 3 * memory.num_samples // 8 + 1  # three epochs and more: the stream wraps like the windows do
    ref = ShardedBatchLoader(memory, 8, 8, shuffle=False)
    want = [ref.next_batch() for _ in range(n_batches)]
    one = batch_loader(stream, 8, 8, 0, 1, seed=0)
    assert _same_batches([one.next_batch() for _ in range(n_batches)], want)
    ranks = [batch_loader(stream, 8, 2, r, 2, seed=0) for r in range(2)]
    for k in range(n_batches):  # dp 2 x micro 2: the slices of the same global batch
        got = torch.cat([x for ld in ranks for x, _ in ld.next_batch()])
        assert torch.equal(got, want[k][0][0])


def test_streaming_resumes_exactly_mid_epoch_with_and_without_a_worker(stream_files, tmp_path):
    from meshforge.data import batch_loader
    from meshforge.data.workers import BackgroundLoader

    stream = build_source(_stream_cfg(stream_files), seq_len=16, vocab_size=256, seed=0)
    ref = batch_loader(stream, 8, 2, 1, 2, seed=0)
    want = [ref.next_batch() for _ in range(16)]  # an epoch is 92 windows, 11.5 global batches
    bg = BackgroundLoader(batch_loader(stream, 8, 2, 1, 2, seed=0), num_workers=1, prefetch_factor=2)
    got = [bg.next_batch() for _ in range(12)]  # tokenized in the worker, batches 12.. prefetched
    torch.save(bg.state_dict(), tmp_path / "state.pt")
    bg.close()
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert state["step"] == 12 and state["position"][0] == 1  # mid second epoch
    assert _same_batches(got, want[:12])
    for resumed in (batch_loader(stream, 8, 2, 1, 2, 0), BackgroundLoader(batch_loader(stream, 8, 2, 1, 2, 0), 1, 2)):
        resumed.load_state_dict(state)
        assert _same_batches([resumed.next_batch() for _ in range(4)], want[12:])
        resumed.close()
    at_one = batch_loader(stream, 8, 8, 0, 1, seed=0)  # the same state at another world size: the same batch 12
    at_one.load_state_dict(state)
    assert torch.equal(at_one.next_batch()[0][0][4:], torch.cat([x for x, _ in want[12]]))
    with pytest.raises(ValueError, match="global_batch_size"):
        batch_loader(stream, 4, 2, 0, 1, seed=0).load_state_dict(state)


def test_streaming_keys():
    from meshforge.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="data.streaming is not read with data.source=dataset data.format=chat"):
        load_config(None, ["data.source=dataset", "data.paths=[x.jsonl]", "data.format=chat", "data.streaming=true"],
                    world_size=1)
    with pytest.raises(ConfigError, match="data.num_workers=2 must be 0 or 1"):
        load_config(None, ["data.source=dataset", "data.paths=[x.jsonl]", "data.streaming=true",
                           "data.num_workers=2"], world_size=1)
    with pytest.raises(ConfigError, match="with data.streaming give data.validation.paths"):
        load_config(None, ["data.source=dataset", "data.paths=[x.jsonl]", "data.streaming=true",
                           "data.validation.fraction=0.1", "training.val_every=2"], world_size=1)


def test_max_files_is_read_only_by_text():
    from meshforge.config import ConfigError, load_config

    assert load_config("examples/tiny_cpu.yaml", [], world_size=1).data.max_files == 60
    with pytest.raises(ConfigError, match="data.max_files is not read with data.source=synthetic.*"
                                          "override data.max_files=null$"):
        load_config("examples/tiny_cpu.yaml", ["data.source=synthetic"], world_size=1)
    assert load_config("examples/tiny_cpu.yaml", ["data.source=synthetic", "data.max_files=null"], world_size=1)


def test_streaming_validation_files_are_read_in_memory(stream_files):
    from meshforge.config import load_config
    from meshforge.data.sources import split_validation

    cfg = load_config(None, ["data.source=dataset", f"data.paths=[{stream_files[0]}]", "data.streaming=true",
                             f"data.validation.paths=[{stream_files[1]}]", "training.val_every=2"], world_size=1)
    train_src, val_src = split_validation(cfg.data, build_source(cfg.data, 16, 256, 0), 16, 256, 0)
    assert train_src.streaming and val_src.num_samples == build_source(
        _stream_cfg(stream_files[1:], False), seq_len=16, vocab_size=256, seed=0).num_samples


def test_bad_data_in_a_worker_is_one_line(tmp_path):
    from meshforge.data import batch_loader
    from meshforge.data.workers import BackgroundLoader

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "' + "a" * 40 + '"}\n{"txt": "no text field"}\n')
    ld = BackgroundLoader(batch_loader(build_source(_stream_cfg([str(bad)]), seq_len=16, vocab_size=256, seed=0),
                                       2, 2, 0, 1, 0), num_workers=1, prefetch_factor=2)
    assert len(ld.next_batch()) == 1  # the first record holds the first batch
    with pytest.raises(DataError) as err:
        ld.next_batch()
    assert err.value.problems == [f"data: {bad} record 1 has no field 'text' (fields: txt)"]
    ld.close()
