"""Gemma 3 270M (Q4_K_M GGUF from the optional package) against transformers and sentencepiece.

Prompts are longer than the 512-token window, so the sliding layers really drop keys. The
reference is ``Gemma3ForCausalLM.from_pretrained(folder, gguf_file=...)`` (``hf_from_gguf``):
transformers' own GGUF reader, name mapping and dequantization, independent of ours.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from engine.forward_batch import ForwardMode
from engine.gemma3_package import GEMMA3_PACKAGE, INSTALL_HINT
from engine.llm import LLM, run_batch
from engine.model_runner import ModelRunner, SeqChunk
from tests.support.models import engine_cfg, hf_from_gguf, sched_cfg
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # Gemma 3 against transformers

if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
    pytest.skip(
        f"GEMMA 3 TESTS SKIPPED: package {GEMMA3_PACKAGE!r} is not installed; {INSTALL_HINT}", allow_module_level=True
    )

NEW = 8
LOGIT_TOL = 2e-3  # fp32; measured ~6e-5 (logits are O(10))
# Expected ids: Google's sentencepiece 0.2.3 (BPE, byte fallback, identity normalizer, no dummy
# prefix) over a ModelProto rebuilt from this GGUF's tokens/scores/types; the first three also
# equal transformers' GemmaTokenizer built from the same GGUF.
TOKENIZER_CASES = [
    ("Hello world", [9259, 1902]),
    ("The capital of France is", [818, 5279, 529, 7001, 563]),
    (
        "  two  spaces\n\nnewlines 12345 h\u00e9llo \u65e5\u672c\u8a9e \U0001f916",
        [
            138,
            13498,
            138,
            35220,
            108,
            208697,
            236743,
            236770,
            236778,
            236800,
            236812,
            236810,
            534,
            7869,
            844,
            33375,
            238582,
            236743,
            246143,
        ],
    ),
    (" leading space and trailing ", [5830, 2557, 532, 45330, 236743]),
    (
        "tab\there\t\tdouble, punctuation!? (yes) -- 3.14159 e=mc^2",
        [
            4823,
            255968,
            8472,
            255969,
            7902,
            236764,
            88078,
            64899,
            568,
            4443,
            236768,
            2617,
            236743,
            236800,
            236761,
            236770,
            236812,
            236770,
            236810,
            236819,
            545,
            236784,
            25408,
            236884,
            236778,
        ],
    ),
    (
        "\x01\x7f control bytes \u2603 snowman \U00013000 hieroglyph",
        [249732, 251541, 2256, 17234, 236743, 246690, 62274, 236743, 478, 385, 366, 366, 10211, 47999, 791],
    ),
    (
        "unbelievably antidisestablishmentarianism supercalifragilistic",
        [602, 8145, 20873, 2579, 2314, 33090, 163524, 8225, 1929, 2393, 1653, 584, 16100, 543, 3316],
    ),
    (
        "def f(x):\n    return x**2  # comment\n",
        [2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865, 5739, 107],
    ),
]
WORDS = (
    "river mountain seven quickly bright library engine orange whisper north castle number "
    "garden silver eleven market slowly window paper thunder"
).split()


@pytest.fixture(scope="module")
def gemma():
    from engine.loader import load_model_weights
    from engine.model_paths import resolve_model_path
    from engine.tokenizer import Tokenizer

    path = resolve_model_path("gemma3-270m")
    return (*load_model_weights(path), Tokenizer.from_path(path), path)


@pytest.fixture(scope="module")
def prompts(gemma):
    """Two prompts of 540 and 520 tokens (BOS first) sharing their first 300 tokens."""
    tok = gemma[2]
    rng = random.Random(12)
    text = " ".join(
        f"{rng.choice(WORDS)} {rng.randint(0, 99)}." if i % 7 == 0 else rng.choice(WORDS) for i in range(900)
    )
    ids = tok.encode(text, add_special_tokens=True)
    other = tok.encode(" ".join(rng.choice(WORDS) for _ in range(600)))
    return [ids[:540], ids[:300] + other[:220]]


@pytest.fixture(scope="module")
def hf_ref(gemma, prompts):
    """Per prompt: transformers' greedy tokens and the logits of each step (prefill, then decode)."""
    from transformers import Gemma3ForCausalLM

    model = hf_from_gguf(Gemma3ForCausalLM, gemma[3])
    assert model.config.sliding_window == 512 and model.config.layer_types[5] == "full_attention"
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=0,
            )
            refs.append((out.sequences[0, len(p) :].tolist(), [lg[0] for lg in out.logits]))
    return refs


def test_config_from_gguf_metadata(gemma):
    cfg = gemma[0]
    assert cfg.arch == "gemma3" and cfg.num_layers == 18 and cfg.sliding_window == 512
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size) == (4, 1, 256, 640)
    assert cfg.bos_token_id == 2 and cfg.eos_token_ids == (1, 106)


@pytest.mark.parametrize("text,ids", TOKENIZER_CASES)
def test_tokenizer_matches_sentencepiece(gemma, text, ids):
    tok = gemma[2]
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == [2, *ids]


def test_chat_template_and_special_tokens(gemma):
    tok = gemma[2]
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
    # control tokens map to their ids; the text between them as sentencepiece splits it
    assert tok.encode(text) == [2, 105, 2364, 107, 3912, 8652, 236761, 108, 10979, 236888, 106, 107, 105, 4368, 107]
    assert tok.eos_token_ids == (1, 106)
    assert tok.decode([2, 105, 10979, 106], skip_special_tokens=True) == "Hi"


def test_logits_match_transformers_prefill_in_chunks_then_decode(gemma, prompts, hf_ref):
    """Prefill in two chunks (the second attends to pooled keys across the window), then decode
    HF's greedy tokens one by one; every step's logits equal transformers'."""
    cfg, weights = gemma[0], gemma[1]
    runner = ModelRunner(engine_cfg(kv_pool_tokens=1024, page_size=16, swa_pool_tokens=1024), cfg, weights)
    assert runner.pools.swa is not None and runner.pools.swa.num_layers == 15  # sliding layers: SWA pool
    prompt, (ref_tokens, ref_logits) = prompts[0], hf_ref[0]
    pages = list(range(runner.pool.num_pages))
    runner.forward(ForwardMode.EXTEND, [SeqChunk(prompt[:333], 0, pages, pages)])
    logits = [runner.forward(ForwardMode.EXTEND, [SeqChunk(prompt[333:], 333, pages, pages)])[0]]
    seq = list(prompt)
    for t in ref_tokens[:-1]:
        seq.append(t)
        logits.append(runner.forward(ForwardMode.DECODE, [SeqChunk([t], len(seq) - 1, pages, pages)])[0])
    diffs = [float((ours - ref).abs().max()) for ours, ref in zip(logits, ref_logits)]
    assert max(diffs) < LOGIT_TOL, diffs
    assert [int(lg.argmax()) for lg in logits] == ref_tokens


def _assert_clean(llm: LLM) -> None:
    llm.scheduler.check_integrity()
    usage = llm.scheduler.kv.usage([])
    assert usage.used == 0 and usage.free + usage.cached == usage.total


def test_colocated_greedy_matches_transformers_with_radix_hit(gemma, prompts, hf_ref):
    """A batch of both prompts (chunked prefill), then the second again: its whole prompt, longer
    than the window, comes from the radix cache and the tokens are unchanged."""
    llm = LLM(engine_cfg(kv_pool_tokens=4096, page_size=16), sched_cfg(chunked_prefill_size=256), loaded=gemma[:3])
    sp = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    out = run_batch(llm.scheduler, prompts, [sp, sp])
    assert [o.token_ids for o in out] == [r[0] for r in hf_ref]
    again = run_batch(llm.scheduler, [prompts[1]], [sp])[0]
    assert again.cached_tokens >= 512 and again.token_ids == hf_ref[1][0]
    _assert_clean(llm)


def test_colocated_forced_retract_matches_transformers(gemma, prompts, hf_ref):
    llm = LLM(
        engine_cfg(kv_pool_tokens=4096, page_size=16),
        sched_cfg(retract_test_interval=3, enable_radix_cache=False),
        loaded=gemma[:3],
    )
    sp = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    out = run_batch(llm.scheduler, prompts, [sp, sp])
    assert llm.scheduler.stats.retractions > 0
    assert [o.token_ids for o in out] == [r[0] for r in hf_ref]
    _assert_clean(llm)


@pytest.mark.process
def test_pd_launch_over_http_matches_transformers(prompts, hf_ref, launched_server_per_test):
    """`pdserve launch --mode pd --model gemma3-270m`: real router, prefill and decode processes,
    KV over NIXL; both long prompts (token ids, BOS included) give transformers' greedy tokens,
    and the repeat of one is served from the radix caches with the same tokens."""
    import openai

    srv = launched_server_per_test(
        "pd", "--model", "gemma3-270m", "--kv-pool-tokens", "4096", "--page-size", "16", "--log-level", "WARNING"
    )
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    for p, (ref, _) in [*zip(prompts, hf_ref), (prompts[1], hf_ref[1])]:
        r = client.completions.create(
            model=model,
            prompt=p,
            max_tokens=NEW,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert r.choices[0].token_ids == ref
    assert r.usage.prompt_tokens_details.cached_tokens >= 512


def test_pd_with_the_swa_pool_under_forced_retract_matches_transformers(gemma, prompts, hf_ref):
    """PD in one process (real schedulers, loopback KV transport), the SWA pool on both sides,
    the decode radix cache on and a retract every third decode step (offload of the full KV and
    the window, then resume): both long prompts give transformers' greedy tokens, the window
    really drops SWA pages, and every pool is back to its free + cached state."""
    from bench.harness.pd_harness import PDHarness
    from configs.schema import PdserveConfig

    def cfg(**sched):
        return PdserveConfig.model_validate(
            {
                "engine": {"kv_pool_tokens": 4096, "page_size": 16, "swa_pool_tokens": 2048, "dtype": "float32"},
                "scheduler": {"chunked_prefill_size": 256, **sched},
                "cluster": {"mode": "pd", "host_kv_pool_gb": 0.2, "transfer_backend": "loopback"},
            }
        )

    h = PDHarness(cfg(), cfg(retract_test_interval=3), gemma[0], gemma[1], eos=(1, 106))
    try:
        assert h.d_runner.pools.swa.num_layers == 15 and h.d_runner.pools.full.num_layers == 3
        sp = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
        for i, p in enumerate(prompts):
            h.submit(f"g{i}", p, sp)
        got: dict[str, tuple[list, list]] = {}
        while h.busy:
            for d in h.step():
                got.setdefault(d.rid, ([], []))[0].extend(d.token_ids)
                got[d.rid][1].extend(d.logprobs)
        for i, (ref_tokens, ref_logits) in enumerate(hf_ref):
            tokens, logprobs = got[f"g{i}"]
            assert tokens == ref_tokens
            # the chosen token's logprob at every step (the first from the prefill worker's manifest)
            want = [float(torch.log_softmax(lg.float(), -1)[t]) for lg, t in zip(ref_logits, ref_tokens)]
            assert max(abs(a - b) for a, b in zip(logprobs, want)) < LOGIT_TOL
        st = h.decode.retract.stats
        assert st.offloaded > 0 and st.resumed > 0
        assert h.decode.kv.swa_pages_released > 0
        h.check_clean()
    finally:
        h.close()
