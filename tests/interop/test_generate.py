"""KV-cached generation, the milestone sampler of a real run, and `lm sample`."""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from lm.base.exits import Refused
from lm.cli import main as lm
from lm.interop.generate import complete, generate
from lm.interop.hf import load_run
from lm.model import KVCache, ModelConfig, Transformer
from lm.run.train import main


def tiny_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=300, n_layer=2, d_model=64, n_head=4, max_seq_len=48, vocab_multiple=64)
    return Transformer(ModelConfig(**{**cfg, **overrides})).eval()


@pytest.mark.parametrize("kv_heads", [None, 2])  # plain multi-head and grouped-query attention
def test_cached_logits_equal_the_full_forward(kv_heads):
    model = tiny_model(n_kv_head=kv_heads)
    ids = torch.randint(0, 300, (2, 20))
    full = model(ids)
    cache = KVCache(model.cfg, 2, torch.device("cpu"), torch.float32)
    # A 12-token prefill, a 5-token chunk, then 3 single tokens: every path of the cached attention.
    parts = [model(ids[:, :12], kv_cache=cache), model(ids[:, 12:17], kv_cache=cache)]
    parts += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(17, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.pos == 20
    assert not any("cache" in k for k in model.state_dict())  # checkpoints are unaffected


@pytest.mark.parametrize(("temperature", "top_k"), [(0.0, None), (1.0, None), (0.8, 20)])
def test_kv_cached_generation_equals_uncached_generation(temperature, top_k):
    model = tiny_model(n_kv_head=2)
    prompt = [5, 17, 42, 7]
    kwargs = dict(temperature=temperature, top_k=top_k, seed=3)
    cached = generate(model, prompt, 40, **kwargs)
    assert cached == generate(model, prompt, 40, use_cache=False, **kwargs)
    assert len(cached) == 40


def test_generation_stops_at_the_context_and_at_the_stop_token():
    model = tiny_model()
    assert len(generate(model, list(range(40)), 100)) == 48 - 40
    first = generate(model, [1, 2, 3], 1)[0]
    assert generate(model, [1, 2, 3], 30, stop_id=first) == [first]
    with pytest.raises(Refused, match="shorten the prompt"):
        generate(model, list(range(48)), 5)


def test_complete_stops_at_the_given_end_of_text_id_not_at_zero():
    """A tokenizer whose end of text is not id 0 (gpt2's is 50256): the text ends at its id, without it."""
    model, tokenizer = (
        tiny_model(),
        Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")),
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces
    ids = generate(model, [1, 2, 3], 6)
    stop = ids[2]
    assert stop != 0 and stop not in ids[:2]
    assert complete(model, tokenizer, "w1 w2 w3", 6, stop_id=stop) == tokenizer.decode(ids[:2])


def test_sampling_is_seeded_and_private():
    model = tiny_model()
    a = generate(model, [1, 2, 3], 30, temperature=1.0, seed=1)
    torch.manual_seed(123)  # the global RNG must not matter
    torch.rand(10)
    assert generate(model, [1, 2, 3], 30, temperature=1.0, seed=1) == a
    assert generate(model, [1, 2, 3], 30, temperature=1.0, seed=2) != a


@pytest.mark.slow  # 17-23 s on 2 cores: headroom under the README command's 10 min
def test_milestone_samples_of_a_real_run_and_lm_sample(tiny_cfg, tmp_path, capsys):
    common = [
        "trainer.val_every_steps=100",
        "sampling.steps=[3]",
        "sampling.max_new_tokens=12",
        "phases.phases=[{name:first,end_step:5},{name:second,end_step:100}]",
    ]
    main(tiny_cfg(*common, "trainer.max_steps=8"))
    main(tiny_cfg(*common, "trainer.max_steps=10"))  # resumes: milestones already sampled are not redone
    run = tmp_path / "runs" / "smoke"
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    # Explicit step 3, the phase boundary at 5, the last step of each invocation (8, then 10).
    assert sorted({r["step"] for r in records}) == [3, 5, 8, 10]
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "In a shocking discovery, scientists found that",
    ]
    for step in (3, 5, 8, 10):
        mine = [r for r in records if r["step"] == step]
        assert sorted((r["prompt"], r["mode"]) for r in mine) == sorted(
            (p, m) for p in prompts for m in ("greedy", "temperature")
        )
    by_step = {r["step"]: r for r in records}
    assert by_step[5]["phase"] == "first" and by_step[8]["phase"] == "second"
    assert by_step[10]["tokens"] == 10 * 8 * 64  # steps x batch x seq_len
    report = (run / "report.md").read_text()
    assert "## Samples at milestones" in report and "| 10 | second |" in report

    # The same checkpoint and seed give identical samples; another seed gives another text.
    ckpt = run / "checkpoints" / "last.ckpt"
    loaded = load_run(ckpt)
    model, again = loaded.model, load_run(run).model
    tokenizer = Tokenizer.from_file(str(loaded.tokenizer_path))
    prompt = "def fibonacci(n):"
    first = complete(model, tokenizer, prompt, 24, temperature=1.0, seed=7)
    assert first == complete(again, tokenizer, prompt, 24, temperature=1.0, seed=7)
    assert first != complete(again, tokenizer, prompt, 24, temperature=1.0, seed=8)
    # The run's own greedy milestone sample is what `lm sample` prints for that prompt.
    greedy = next(r for r in records if r["step"] == 10 and r["prompt"] == prompt and r["mode"] == "greedy")
    capsys.readouterr()
    lm(["sample", str(ckpt), prompt, "--max-new-tokens", "12"])
    assert capsys.readouterr().out == prompt + greedy["text"] + "\n"


def test_lm_sample_names_a_missing_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint at"):
        lm(["sample", str(tmp_path / "nope.ckpt"), "hi"])
