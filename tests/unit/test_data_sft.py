"""Tokenizers, record files, SFT label masks (hand-checked), `data prepare --tokenizer`, bad data as one line.

The tokenizer is the one shipped with the SFT example (examples/data/chat_tokenizer, a 320-token BPE made by
`meshforge data tokenizer train`); its chat template is rendered by transformers itself.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from meshforge.cli import main
from meshforge.config.schema import DataConfig
from meshforge.data import DataError, ShardedBatchLoader, build_source
from meshforge.data.examples import ExampleSource, chat, prompt_completion
from meshforge.data.tokenizer import ByteTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "data" / "chat_tokenizer"
CHAT = ROOT / "examples" / "data" / "chat_tiny.jsonl"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(TOKENIZER))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def runs(ids, mask):
    """The token runs that carry loss, as id lists."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


# ----------------------------------------------------------------------------------------- tokenizers
def test_tokenizer_train_load_round_trip(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 40 + "hello world, hello meshforge\n" * 40)
    assert main(["data", "tokenizer", "train", str(text), "--vocab-size", "300", "-o", str(tmp_path / "tk")]) == 0
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tk"), local_files_only=True)
    ours, raw = load_tokenizer(str(tmp_path / "tk")), load_tokenizer(str(tmp_path / "tk" / "tokenizer.json"))
    s = "hello brown fox, ünïcode too"
    assert ours.vocab_size == raw.vocab_size == len(hf) == 300
    assert ours.encode(s) == raw.encode(s) == hf(s, add_special_tokens=False)["input_ids"]
    assert hf.decode(ours.encode(s)) == s and len(ours.encode("hello world")) < len("hello world")  # merges learnt
    assert ours.eos_id == hf.convert_tokens_to_ids("<|endoftext|>")
    assert main(["data", "tokenizer", "train", str(text), "--vocab-size", "100", "-o", str(tmp_path / "x")]) == 2
    assert "too small" in capsys.readouterr().err


def test_vocab_mismatch_refused(tmp_path, capsys):
    cfg = DataConfig(source="dataset", paths=[str(CHAT)], tokenizer=str(TOKENIZER), format="chat")
    with pytest.raises(DataError, match="has 320 tokens but model.vocab_size=256: set model.vocab_size=320"):
        build_source(cfg, 64, 256, 0)
    assert build_source(cfg, 64, 384, 0).num_samples == 96  # a larger (padded) model vocabulary is allowed
    rc = main(["train", str(ROOT / "examples" / "sft_tiny_cpu.yaml"), "model.vocab_size=300",
               f"run.output_dir={tmp_path}", "training.max_steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.vocab_size=300" in err[0]


# ----------------------------------------------------------------------------------------- SFT masks
def test_chat_template_and_answer_mask_hand_checked(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"},
            {"role": "assistant", "content": "Lima."}, {"role": "user", "content": "And 2 plus 2?"},
            {"role": "assistant", "content": "4"}]
    want = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of Peru?<|im_end|>\n"
            "<|im_start|>assistant\nLima.<|im_end|>\n<|im_start|>user\nAnd 2 plus 2?<|im_end|>\n"
            "<|im_start|>assistant\n4<|im_end|>\n")
    assert tok.render_chat(msgs) == want
    ids, mask = chat({"messages": msgs}, "r", tok, "answer")
    hf = tok._hf
    assert hf.decode(ids) == want
    # exactly the two assistant turns (content and end-of-turn) carry loss; system, user and role headers do not
    assert [hf.decode(r) for r in runs(ids, mask)] == ["Lima.<|im_end|>\n", "4<|im_end|>\n"]
    ids_all, mask_all = chat({"messages": msgs}, "r", tok, "all")
    assert ids_all == ids and all(mask_all)


def test_prompt_completion_labels_hand_checked(tmp_path):
    ids, mask = prompt_completion({"prompt": "ab", "completion": "cd"}, "r", ByteTokenizer(), "answer")
    assert ids == [97, 98, 99, 100, 0] and mask == [False, False, True, True, True]
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "ab", "completion": "cd"}])
    x, y = ExampleSource([path], "prompt_completion", ByteTokenizer(), 6, "answer", "truncate").batch([0])
    assert x.tolist() == [[97, 98, 99, 100, 0, 0]] and y.tolist() == [[-100, 99, 100, 0, -100, -100]]
    x, y = ExampleSource([path], "prompt_completion", ByteTokenizer(), 6, "all", "truncate").batch([0])
    assert y.tolist() == [[98, 99, 100, 0, -100, -100]]


def test_too_long_truncates_or_drops(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "abc", "completion": "defgh"},  # 9 tokens with EOS
                                               {"prompt": "a", "completion": "b"}])
    t = ExampleSource([path], "prompt_completion", ByteTokenizer(), 4, "answer", "truncate")
    x, y = t.batch([0])
    assert t.num_samples == 2 and x.tolist() == [[97, 98, 99, 100]] and y.tolist() == [[-100, -100, 100, 101]]
    d = ExampleSource([path], "prompt_completion", ByteTokenizer(), 4, "answer", "drop")
    assert d.num_samples == 1 and d.dropped == 1 and d.batch([0])[0].tolist() == [[97, 98, 0, 0]]
    with pytest.raises(DataError, match="none left to train on"):
        ExampleSource([path], "prompt_completion", ByteTokenizer(), 1, "answer", "drop")


def test_sft_loader_keeps_its_guarantees(tok):
    src = build_source(DataConfig(source="dataset", paths=[str(CHAT)], tokenizer=str(TOKENIZER), format="chat"),
                       48, 320, 0)

    def global_batch(k, dp, m):
        parts = []
        for r in range(dp):
            ld = ShardedBatchLoader(src, 8, m, dp_rank=r, dp_size=dp, seed=3)
            ld.load_state_dict({"step": k})
            parts += ld.next_batch()
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    for k in (0, 13):  # 13: the second epoch (96 examples, 8 per batch)
        ref = global_batch(k, 1, 8)
        for dp, m in ((2, 1), (4, 2)):
            got = global_batch(k, dp, m)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert (ref[1] == -100).any() and (ref[1] != -100).any()
    a = ShardedBatchLoader(src, 8, 2, seed=3)
    a.next_batch()
    b = ShardedBatchLoader(src, 8, 2, seed=3)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(p[1], q[1]) for p, q in zip(a.next_batch(), b.next_batch()))


# ----------------------------------------------------------------------------------------- record files
def test_record_formats_agree(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"text": f"document {i} " * (i + 3), "n": i} for i in range(12)]
    table = pa.Table.from_pylist(records)
    write_jsonl(tmp_path / "d.jsonl", records)
    pq.write_table(table, tmp_path / "d.parquet")
    with pa.ipc.new_file(str(tmp_path / "f.arrow"), table.schema) as w:
        w.write_table(table)
    with pa.ipc.new_stream(str(tmp_path / "s.arrow"), table.schema) as w:
        w.write_table(table)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    want = b"".join(r["text"].encode() + b"\0" for r in records)
    for name in ("d.jsonl", "d.parquet", "f.arrow", "s.arrow", "saved"):
        src = build_source(DataConfig(source="dataset", paths=[str(tmp_path / name)]), 16, 256, 0)
        assert bytes(src.tokens.astype(np.uint8)) == want, name


def test_prepare_with_tokenizer(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "What is 2 plus 2?"}, {"body": "The capital of Peru."}])
    out = tmp_path / "t.npy"
    assert main(["data", "prepare", str(path), "--tokenizer", str(TOKENIZER), "--text-field", "body",
                 "-o", str(out)]) == 0
    want = tok.encode("What is 2 plus 2?") + [tok.eos_id] + tok.encode("The capital of Peru.") + [tok.eos_id]
    assert np.load(out).tolist() == want
    src = build_source(DataConfig(source="tokenized", path=str(out), tokenizer=str(TOKENIZER)), 4, 320, 0)
    assert src.sample(0).tolist() == want[:5]


def _tokenizer_with_template(tmp_path, template):
    d = tmp_path / "tk"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_text((TOKENIZER / f).read_text())
    (d / "chat_template.jinja").write_text(template)
    return str(d)


@pytest.mark.parametrize("records, match", [
    ([{"txt": "x"}], "record 0 has no field 'text'"),
    ([{"text": 3}], "field 'text' is a int, expected str"),
    ([], "holds no records"),
])
def test_bad_records_are_one_line(tmp_path, records, match):
    path = write_jsonl(tmp_path / "d.jsonl", records)
    with pytest.raises(DataError, match=match) as err:
        build_source(DataConfig(source="dataset", paths=[str(path)]), 4, 256, 0)
    assert "\n" not in str(err.value)


def test_bad_sft_data_and_templates_are_one_line(tmp_path, capsys):
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(DataError, match="string 'role' and 'content'"):
        build_source(DataConfig(source="dataset", paths=[str(bad)], tokenizer=str(TOKENIZER), format="chat"),
                     16, 320, 0)
    (tmp_path / "u.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(DataError, match="is not UTF-8 text"):
        build_source(DataConfig(source="dataset", paths=[str(tmp_path / "u.jsonl")]), 16, 256, 0)
    (tmp_path / "j.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match="line 1 is not JSON"):
        build_source(DataConfig(source="dataset", paths=[str(tmp_path / "j.jsonl")]), 16, 256, 0)
    with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
        build_source(DataConfig(source="dataset", paths=[str(CHAT)], format="chat"), 16, 256, 0)
    failing = _tokenizer_with_template(tmp_path, "{{ raise_exception('roles must alternate') }}")
    cfg = DataConfig(source="dataset", paths=[str(CHAT)], tokenizer=failing, format="chat")
    with pytest.raises(DataError, match="chat template of .* failed: .*roles must alternate"):
        build_source(cfg, 16, 320, 0)
    rc = main(["train", str(ROOT / "examples" / "sft_tiny_cpu.yaml"), f"data.tokenizer={failing}",
               f"run.output_dir={tmp_path / 'run'}", "training.max_steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "roles must alternate" in err[0]


def test_unread_data_keys_are_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="data.loss_on is not read"):
        DataConfig(source="dataset", paths=["x.jsonl"], loss_on="all")
    with pytest.raises(ValidationError, match="data.format is not read"):
        DataConfig(source="text", format="chat")
    with pytest.raises(ValidationError, match="needs data.paths"):
        DataConfig(source="dataset")
