"""logprobs, n > 1, /v1/models capabilities and editors' request bodies against real
nodes (SmolLM2 on llama.cpp, real HTTP): one node, and a 2-stage split of real node
processes whose logprobs and choices must equal the single node's."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema_rs
import pytest

from tests.nodeproc import start_node
from tests.test_split_serving import NODE_FLAGS, _home_with_model, _same_mesh, _wait_ready, solo_node

pytestmark = pytest.mark.slow

COMPAT = Path(__file__).parent / "compat"
CHAT = [{"role": "user", "content": "Name three colours."}]


def _post(port: int, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=120)


def _model(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]


def _sse(r: httpx.Response) -> tuple[list[dict], bool]:
    chunks, done = [], False
    for line in r.text.splitlines():
        if line.startswith("data: "):
            if line == "data: [DONE]":
                done = True
            else:
                chunks.append(json.loads(line[6:]))
    return chunks, done


def _token_id(model_path: Path, text: str) -> int:
    from meshnode.engine.tokenizer import Tokenizer

    ids = Tokenizer(model_path).encode(text, add_bos=False, special=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def _observations(port: int, model_path: Path) -> dict:
    """What the tests compare between one node and a split."""
    model = _model(port)
    out: dict = {}
    r = _post(port, "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 6,
                                             "temperature": 0, "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    out["chat_logprobs"] = r.json()["choices"][0]["logprobs"]["content"]
    out["chat_text"] = r.json()["choices"][0]["message"]["content"]
    r = _post(port, "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 6,
                                             "temperature": 0, "logprobs": True, "top_logprobs": 3,
                                             "stream": True})
    chunks, done = _sse(r)
    assert done
    out["chat_stream_logprobs"] = [e for c in chunks for ch in c["choices"]
                                   for e in ((ch.get("logprobs") or {}).get("content") or [])]
    r = _post(port, "/v1/completions", {"model": model, "prompt": "The capital of France is",
                                        "max_tokens": 5, "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    out["text_logprobs"] = r.json()["choices"][0]["logprobs"]
    # the same prompt as token ids (as the text path tokenizes it, BOS included)
    from meshnode.engine.tokenizer import Tokenizer

    ids = Tokenizer(model_path).encode("The capital of France is", add_bos=True)
    r = _post(port, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 5, "temperature": 0,
                                        "logprobs": 2})
    assert r.status_code == 200, r.text
    out["ids_logprobs"] = r.json()["choices"][0]["logprobs"]
    out["ids_usage"] = r.json()["usage"]["prompt_tokens"], len(ids)
    r = _post(port, "/v1/completions", {"model": model, "prompt": [1, 10**9], "max_tokens": 5})
    out["ids_bad"] = r.status_code, r.json()["error"]["param"], "10000000" in r.json()["error"]["message"]
    # logit_bias: +100 on one token at every step; -100 on the greedy answer's first token
    blue = _token_id(model_path, " blue")
    r = _post(port, "/v1/completions", {"model": model, "prompt": "The capital of France is", "max_tokens": 3,
                                        "temperature": 0, "logprobs": 0, "logit_bias": {str(blue): 100}})
    assert r.status_code == 200, r.text
    out["forced_tokens"] = r.json()["choices"][0]["logprobs"]["tokens"]
    first = _token_id(model_path, out["text_logprobs"]["tokens"][0])
    r = _post(port, "/v1/completions", {"model": model, "prompt": "The capital of France is", "max_tokens": 5,
                                        "temperature": 0, "logprobs": 2, "logit_bias": {str(first): -100}})
    assert r.status_code == 200, r.text
    out["banned_logprobs"] = r.json()["choices"][0]["logprobs"]
    # penalties: the counts travel with every step to the final stage
    r = _post(port, "/v1/completions", {"model": model, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 12,
                                        "temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5})
    assert r.status_code == 200, r.text
    out["penalized"] = r.json()["choices"][0]["text"]
    r = _post(port, "/v1/completions", {"model": model, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 12,
                                        "temperature": 0})
    out["unpenalized"] = r.json()["choices"][0]["text"]
    # the repetition penalty: vLLM's over the whole context, llama.cpp's over a window
    r = _post(port, "/v1/completions", {"model": model, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 12,
                                        "temperature": 0, "repetition_penalty": 1.5})
    assert r.status_code == 200, r.text
    out["repeated"] = r.json()["choices"][0]["text"]
    out["repeated_llamacpp"] = _post(port, "/completion", {"prompt": "1, 2, 3, 4, 5,", "n_predict": 12,
                                                           "temperature": 0, "repeat_penalty": 1.5,
                                                           "repeat_last_n": 8}).json()["content"]
    out["repeated_bad"] = [(r.status_code, r.json()["error"]["param"]) for r in (
        _post(port, "/v1/completions", {"model": model, "prompt": "x", "repetition_penalty": 0}),
        _post(port, "/v1/completions", {"model": model, "prompt": "x", "repetition_penalty": 1.2,
                                        "repeat_penalty": 1.2}),
        _post(port, "/completion", {"prompt": "x", "repeat_penalty": 1.1, "repeat_last_n": -2}))]
    r = _post(port, "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 8,
                                             "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    out["greedy_n2"] = [c["message"]["content"] for c in r.json()["choices"]]
    out["greedy_n2_usage"] = r.json()["usage"]
    sampled = {"model": model, "messages": CHAT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    out["sampled_n2"] = []
    for _ in range(2):
        r = _post(port, "/v1/chat/completions", sampled)
        assert r.status_code == 200, r.text
        out["sampled_n2"].append([c["message"]["content"] for c in r.json()["choices"]])
    r = _post(port, "/v1/chat/completions", {**sampled, "stream": True, "stream_options": {"include_usage": True}})
    chunks, done = _sse(r)
    assert done
    texts = ["", ""]
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
    out["sampled_n2_stream"] = texts
    # min_p 1 keeps the most probable token only: sampling then gives the greedy answer
    r = _post(port, "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 8,
                                             "temperature": 1.0, "seed": 3, "min_p": 1.0})
    out["min_p_1"] = r.json()["choices"][0]["message"]["content"]
    r = _post(port, "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 8,
                                             "temperature": 1.0, "seed": 3, "min_p": 0.2})
    out["min_p_02"] = r.json()["choices"][0]["message"]["content"]
    out["sampled_n2_finishes"] = sorted(ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"])
    out.update(_echo_observations(port, model_path))
    return out


LONG_PROMPT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(12))


def _echo_observations(port: int, model_path: Path) -> dict:
    """OpenAI's echo, as lm-eval's loglikelihood requests send it (token ids, max_tokens
    0-1, logprobs 1): the prompt's tokens scored on the final stage."""
    from meshnode.engine.tokenizer import Tokenizer

    model, tok = _model(port), Tokenizer(model_path)
    out: dict = {}
    prompt = tok.encode("The capital of France is", add_bos=True)
    r = _post(port, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                        "logprobs": 2})
    out["echo_generated"] = gen = r.json()["choices"][0]["logprobs"]
    answer = [_token_id(model_path, t) for t in gen["tokens"]]
    # the prompt and its greedy answer, scored: no token generated
    r = _post(port, "/v1/completions", {"model": model, "prompt": prompt + answer, "max_tokens": 0, "echo": True,
                                        "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    out["echo_scored"] = r.json()["choices"][0]
    out["echo_scored_usage"] = r.json()["usage"]
    out["echo_n_prompt"] = len(prompt)
    # a text prompt, echoed with two generated tokens, streamed and not
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 2, "echo": True,
            "temperature": 0, "logprobs": 1}
    out["echo_text"] = _post(port, "/v1/completions", body).json()["choices"][0]
    chunks, done = _sse(_post(port, "/v1/completions", {**body, "stream": True}))
    assert done
    out["echo_text_stream"] = [(ch["text"], (ch["logprobs"] or {}).get("token_logprobs")) for c in chunks
                               for ch in c["choices"]]
    out["echo_plain"] = _post(port, "/v1/completions", {**body, "echo": False}).json()["choices"][0]["text"]
    # n = 2: the prompt prefilled (and scored) once for both choices
    r = _post(port, "/v1/completions", {**body, "n": 2})
    assert r.status_code == 200, r.text
    out["echo_n2"] = r.json()["choices"]
    # a prompt of several prefill chunks (--batch 64); echo without logprobs
    r = _post(port, "/v1/completions", {"model": model, "prompt": LONG_PROMPT, "max_tokens": 1, "echo": True,
                                        "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    out["echo_long"] = r.json()["choices"][0]
    out["echo_long_usage"] = r.json()["usage"]
    r = _post(port, "/v1/completions", {"model": model, "prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0})
    out["echo_long_plain"] = r.json()["choices"][0]["text"]
    r = _post(port, "/v1/completions", {"model": model, "prompt": LONG_PROMPT, "max_tokens": 1, "echo": True,
                                        "temperature": 0})
    out["echo_long_no_logprobs"] = r.json()["choices"][0]
    r = _post(port, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 0})
    out["max_tokens_0"] = r.status_code, r.json()["error"]["param"]
    # a batch of prompts (as lm-eval sends them: token ids), two choices each, echoed
    batch = [prompt, tok.encode("Paris is a city in", add_bos=True), prompt + answer[:3]]
    body = {"model": model, "max_tokens": 2, "echo": True, "temperature": 0, "logprobs": 1, "n": 2}
    r = _post(port, "/v1/completions", {**body, "prompt": batch})
    assert r.status_code == 200, r.text
    out["batch"] = r.json()["choices"], r.json()["usage"]
    out["batch_each"] = [_post(port, "/v1/completions", {**body, "n": 1, "prompt": p}).json()["choices"][0]
                         for p in batch]
    chunks, done = _sse(_post(port, "/v1/completions", {**body, "prompt": batch, "stream": True}))
    assert done
    streamed: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["text"]
    out["batch_stream"] = streamed
    # a prompt that fills the context (512) gets its one token, scored as lm-eval's
    # log-likelihood of a window as long as the context asks; one more token is too long
    full = (tok.encode(LONG_PROMPT, add_bos=True) * 8)[:512]
    r = _post(port, "/v1/completions", {"model": model, "prompt": full, "max_tokens": 1, "echo": True,
                                        "temperature": 0, "logprobs": 0})
    assert r.status_code == 200, r.text
    out["full_context"] = len(r.json()["choices"][0]["logprobs"]["tokens"]), r.json()["usage"]
    r = _post(port, "/v1/completions", {"model": model, "prompt": full + [full[1]], "max_tokens": 1})
    out["past_context"] = r.status_code, r.json()["error"]["code"]
    # llama.cpp server's /completion (Continue's "llama.cpp" provider): the same greedy text
    # as /v1/completions, streamed and not, for text and token ids
    native = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0}
    out["native"] = [_check_llamacpp(_post(port, "/completion", {**native, "stream": st}), st) for st in (False, True)]
    out["native_ids"] = _check_llamacpp(_post(port, "/completion", {**native, "prompt": prompt}), False)
    out["native_v1"] = _post(port, "/v1/completions", {"model": model, "prompt": "The capital of France is",
                                                       "max_tokens": 6, "temperature": 0}).json()["choices"][0]["text"]
    # n_probs: llama.cpp's completion_probabilities, against /v1's logprobs of the same answer
    r = _post(port, "/completion", {**native, "n_probs": 2}).json()
    out["native_probs"] = {k: r[k] for k in ("content", "completion_probabilities", "tokens_predicted")}
    chunks, _ = _sse(_post(port, "/completion", {**native, "n_probs": 2, "stream": True}))
    out["native_probs_stream"] = [p for c in chunks for p in c.get("completion_probabilities", [])]
    out["native_v1_logprobs"] = _post(port, "/v1/completions", {
        "model": model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
        "logprobs": 2}).json()["choices"][0]["logprobs"]
    # an empty text: SmolLM2 adds no BOS, so no tokens at all
    out["empty_prompt"] = [(r.status_code, r.json()["error"]["param"]) for r in (
        _post(port, "/v1/completions", {"model": model, "prompt": "", "max_tokens": 2}),
        _post(port, "/completion", {"prompt": "", "n_predict": 2}))]
    # the tokenizer endpoints (lm-eval's tokenizer_backend=remote: vLLM's shapes)
    base = f"http://127.0.0.1:{port}"
    out["tokenizer_info"] = httpx.get(f"{base}/tokenizer_info").json()
    out["tokenize"] = _post(port, "/tokenize", {"prompt": "The capital of France is", "add_special_tokens": False}
                            ).json()
    out["tokenize_llamacpp"] = _post(port, "/tokenize", {"content": "<|im_end|> is"}).json()["tokens"]
    out["detokenize"] = _post(port, "/detokenize", {"tokens": out["tokenize"]["tokens"] + [tok.eos_id]}).json()
    r = _post(port, "/detokenize", {"tokens": [1, 10**9]})
    out["detokenize_bad"] = r.status_code, r.json()["error"]["param"]
    r = _post(port, "/tokenize", {"model": "nope", "prompt": "x"})
    out["tokenize_unknown_model"] = r.status_code
    # a conversation, laid out as a chat completion lays it out (vLLM's chat /tokenize)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    tool = {"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}
    out["tokenize_chat"] = [_post(port, "/tokenize", {"messages": chat, **extra}).json()["count"]
                            for extra in ({}, {"add_generation_prompt": False}, {"tools": [tool]})]
    out["chat_prompt_tokens"] = [_post(port, "/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 1,
                                                                      **extra}).json()["usage"]["prompt_tokens"]
                                 for extra in ({}, {"tools": [tool]})]
    out["tokenize_chat_bad"] = [(r.status_code, r.json()["error"]["param"]) for r in (
        _post(port, "/tokenize", {"messages": chat, "prompt": "x"}), _post(port, "/tokenize", {"tools": [tool],
                                                                                               "prompt": "x"}))]
    return out


@pytest.fixture(scope="module")
def single(smollm2, tmp_path_factory):
    with solo_node(tmp_path_factory.mktemp("api-single"), smollm2.path) as node:
        yield node, _observations(node.info["http_port"], smollm2.path)


def test_logprobs_are_log_softmax_shaped_and_streamed_the_same(single):
    _, obs = single
    content = obs["chat_logprobs"]
    assert 1 <= len(content) <= 6
    assert "".join(e["token"] for e in content) == obs["chat_text"]
    for e in content:
        tops = e["top_logprobs"]
        assert len(tops) == 3 and all(t["logprob"] <= 0 for t in tops)
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        # greedy: the sampled token is the most likely one
        assert tops[0]["token"] == e["token"] and tops[0]["logprob"] == e["logprob"]
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
    assert obs["chat_stream_logprobs"] == content
    text = obs["text_logprobs"]
    assert len(text["tokens"]) == len(text["token_logprobs"]) == len(text["top_logprobs"]) == 5
    assert all(len(t) == 2 for t in text["top_logprobs"])
    assert text["text_offset"][0] == 0 and text["text_offset"] == sorted(text["text_offset"])


def test_a_prompt_of_token_ids_is_the_same_prompt(single):
    _, obs = single
    assert obs["ids_logprobs"] == obs["text_logprobs"]
    n, want = obs["ids_usage"]
    assert n == want
    assert obs["ids_bad"] == (400, "prompt", True)


def test_logit_bias_forces_and_bans_tokens(single):
    _, obs = single
    assert obs["forced_tokens"] == [" blue"] * 3
    plain, banned = obs["text_logprobs"], obs["banned_logprobs"]
    assert banned["tokens"][0] != plain["tokens"][0]
    # logprobs are the model's own: the banned token still leads the alternatives
    assert next(iter(banned["top_logprobs"][0])) == plain["tokens"][0]


def test_penalties_change_a_repetitive_answer(single):
    _, obs = single
    plain, penalized = obs["unpenalized"], obs["penalized"]
    assert plain != penalized, plain
    # the count goes on with ", " between numbers; penalized, the commas thin out
    assert penalized.count(",") < plain.count(","), (plain, penalized)
    # the repetition penalty: every token of the context (the prompt's too) weighs less
    assert obs["repeated"] != plain and obs["repeated"].count(",") < plain.count(","), obs["repeated"]
    assert obs["repeated_llamacpp"] not in (plain, ""), obs["repeated_llamacpp"]
    assert obs["repeated_bad"] == [(400, "repetition_penalty"), (400, "repeat_penalty"), (400, "repeat_last_n")]


def test_n_choices(single):
    _, obs = single
    assert obs["min_p_1"] == obs["greedy_n2"][0]
    assert obs["min_p_02"]
    a, b = obs["greedy_n2"]
    assert a == b and a
    assert obs["greedy_n2_usage"]["completion_tokens"] >= 2
    first, again = obs["sampled_n2"]
    assert first == again                   # seeded: reproducible
    assert len(set(first)) > 1              # each choice samples on its own
    assert obs["sampled_n2_stream"] == first
    assert obs["sampled_n2_finishes"] == [0, 1]


def test_echo_scores_the_prompt_as_decoding_would(single):
    """lm-eval's loglikelihood: the scored logprobs of a greedy answer's tokens, given the
    prompt, are the ones decoding reported (rows of one chunk of at most 32 tokens, which
    are bit-identical to one-row steps: docs/engine.md), and each is the most likely."""
    _, obs = single
    gen, scored, n = obs["echo_generated"], obs["echo_scored"], obs["echo_n_prompt"]
    lp = scored["logprobs"]
    assert scored["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + len(gen["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["tokens"][n:] == gen["tokens"]
    assert lp["token_logprobs"][n:] == gen["token_logprobs"]
    assert lp["top_logprobs"][n:] == gen["top_logprobs"]
    assert scored["text"] == "".join(lp["tokens"])
    assert obs["echo_scored_usage"]["completion_tokens"] == 0
    assert obs["echo_scored_usage"]["prompt_tokens"] == n + len(gen["tokens"])


def test_echo_returns_the_prompt_then_the_same_answer(single):
    _, obs = single
    prompt = "The capital of France is"
    echo = obs["echo_text"]
    assert echo["text"] == prompt + obs["echo_plain"]
    lp = echo["logprobs"]
    assert lp["text_offset"] == sorted(lp["text_offset"])
    streamed = obs["echo_text_stream"]
    assert streamed[0][0] == prompt and streamed[0][1][0] is None
    assert "".join(t for t, _ in streamed) == echo["text"]
    assert [v for _, lps in streamed for v in lps or []] == lp["token_logprobs"]
    for choice in obs["echo_n2"]:
        assert choice["text"] == echo["text"] and choice["logprobs"] == lp
    long = obs["echo_long"]
    assert long["text"] == LONG_PROMPT + obs["echo_long_plain"]
    n = obs["echo_long_usage"]["prompt_tokens"]
    assert n > 128       # three prefill chunks, each scored
    assert len(long["logprobs"]["token_logprobs"]) == n + 1
    assert all(v is not None and v <= 0 for v in long["logprobs"]["token_logprobs"][1:])
    assert obs["echo_long_no_logprobs"]["text"] == long["text"]
    assert obs["echo_long_no_logprobs"]["logprobs"] is None
    assert obs["max_tokens_0"] == (400, "max_tokens")
    n, usage = obs["full_context"]
    assert n == 513 and (usage["prompt_tokens"], usage["completion_tokens"]) == (512, 1)
    assert obs["past_context"] == (400, "context_length_exceeded")


def test_a_batch_of_prompts_answers_each_as_alone(single):
    _, obs = single
    choices, usage = obs["batch"]
    each = obs["batch_each"]
    assert [c["index"] for c in choices] == list(range(6))
    for i, alone in enumerate(each):
        for c in choices[2 * i:2 * i + 2]:      # choice j of prompt i at index i * n + j
            assert (c["text"], c["logprobs"]) == (alone["text"], alone["logprobs"])
    assert obs["batch_stream"] == {c["index"]: c["text"] for c in choices}
    n_prompt = sum(len(c["logprobs"]["tokens"]) - 2 for c in each)
    assert usage["prompt_tokens"] == n_prompt and usage["completion_tokens"] == 6 * 2


def test_llamacpp_completion_endpoint_answers_as_v1_does(single):
    _, obs = single
    assert obs["native"] == [obs["native_v1"]] * 2 and obs["native_ids"] == obs["native_v1"]
    assert obs["native_v1"]
    assert obs["empty_prompt"] == [(400, "prompt")] * 2


def test_llamacpp_n_probs_are_the_tokens_probabilities(single, smollm2):
    from meshnode.engine.tokenizer import Tokenizer

    _, obs = single
    probs, v1 = obs["native_probs"], obs["native_v1_logprobs"]
    entries = probs["completion_probabilities"]
    assert len(entries) == probs["tokens_predicted"] == len(v1["tokens"])
    assert [e["token"] for e in entries] == v1["tokens"] and [e["logprob"] for e in entries] == v1["token_logprobs"]
    tok = Tokenizer(smollm2.path)
    for e, top in zip(entries, v1["top_logprobs"]):
        assert tok.decode([e["id"]], special=True) == e["token"] and bytes(e["bytes"]) == e["token"].encode()
        assert [(t["token"], t["logprob"]) for t in e["top_logprobs"]] == list(top.items())
        assert all(tok.decode([t["id"]], special=True) == t["token"] for t in e["top_logprobs"])
    assert obs["native_probs_stream"] == entries


def test_tokenizer_endpoints_tokenize_as_the_node_does(single, smollm2):
    from meshnode.engine.tokenizer import Tokenizer

    _, obs = single
    tok = Tokenizer(smollm2.path)
    info = obs["tokenizer_info"]
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 512
    assert info["chat_template"] and info["vocab_size"] == tok.n_vocab
    ids = tok.encode("The capital of France is", add_bos=False)
    assert obs["tokenize"] == {"tokens": ids, "count": len(ids), "max_model_len": 512}
    # special tokens' texts are parsed (lm-eval reads the EOS id so), and rendered back
    assert obs["tokenize_llamacpp"][0] == tok.eos_id and len(obs["tokenize_llamacpp"]) == 2
    assert obs["detokenize"]["prompt"] == obs["detokenize"]["content"] == "The capital of France is<|im_end|>"
    assert obs["detokenize_bad"] == (400, "tokens")
    assert obs["tokenize_unknown_model"] == 404
    # messages: exactly the chat completion's prompt; without the assistant turn's opening
    # (ChatML's "<|im_start|>assistant\n"), shorter by it
    with_turn, without_turn, with_tools = obs["tokenize_chat"]
    assert [with_turn, with_tools] == obs["chat_prompt_tokens"] and with_tools > with_turn
    assert without_turn == with_turn - len(tok.encode("<|im_start|>assistant\n", add_bos=False))
    assert obs["tokenize_chat_bad"] == [(400, "messages"), (400, "tools")]


def test_models_report_context_and_capabilities(single):
    node, _ = single
    port = node.info["http_port"]
    m = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
    assert m["context_length"] == 512
    caps = m["capabilities"]
    assert caps["logprobs"] and caps["n"] and caps["chat"] and not caps["fim"]
    assert caps["tools"] and caps["structured_output"] and "tools" not in m["unsupported"]
    assert "FIM" in m["unsupported"]["fim"]
    r = _post(port, "/v1/completions", {"model": m["id"], "prompt": "def f(", "suffix": ")\n", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "FIM" in r.json()["error"]["message"]
    r = _post(port, "/v1/chat/completions", {"model": m["id"], "messages": CHAT, "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"   # --parallel 2


FIXTURES = sorted(p.name for p in COMPAT.glob("*.json"))
TOKEN_CAP = 8          # text answers: enough to see the stream's shape
FORCED_CAP = 48        # a forced call: room for a short call, cut short otherwise


def _body(case: dict, port: int, cap: int) -> dict:
    """The editor's body with the model name filled in and every token limit capped
    (the editors ask for 4096 or leave it to the context; 2 cores must end in seconds)."""
    body = json.loads(json.dumps(case["body"]).replace('"MODEL"', json.dumps(_model(port))))
    if "n_predict" in body:
        body["n_predict"] = min(body["n_predict"], cap)
    elif "max_completion_tokens" in body:
        body["max_completion_tokens"] = min(body["max_completion_tokens"], cap)
    else:
        body["max_tokens"] = min(body.get("max_tokens", cap), cap)
    return body


def _stream_shape(chunks: list[dict], obj: str) -> tuple[dict[int, dict], str | None]:
    """Checks what every OpenAI streaming client relies on; returns the calls
    reassembled from their deltas (by index) and the finish reason."""
    assert chunks and {c["object"] for c in chunks} == {obj}
    assert len({c["id"] for c in chunks}) == 1
    calls: dict[int, dict] = {}
    finish = None
    for c in chunks:
        for ch in c["choices"]:
            if ch["finish_reason"] is not None:
                assert finish is None, "one finish_reason per choice"
                finish = ch["finish_reason"]
            for d in (ch.get("delta") or {}).get("tool_calls") or []:
                if d["index"] not in calls:
                    # Zed, Cline (AI SDK) and Continue take the id and name from the
                    # first delta of an index and fail or drop the call without them
                    assert d["id"] and d["type"] == "function" and d["function"]["name"], d
                    calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
                else:
                    assert "id" not in d and "name" not in d["function"], d
                calls[d["index"]]["arguments"] += d["function"].get("arguments") or ""
    assert sorted(calls) == list(range(len(calls)))
    return calls, finish


def _check_calls(calls: dict[int, dict], finish: str | None, tools: list[dict], forced: bool) -> None:
    names = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if calls:
        assert finish in ("tool_calls", "length")
    if forced:
        assert calls or finish == "length"
    complete = calls if finish == "tool_calls" else {i: c for i, c in calls.items() if i < len(calls) - 1}
    for c in complete.values():
        assert c["name"] in names
        jsonschema_rs.validate(names[c["name"]], json.loads(c["arguments"]))


def _replay(port: int, case: dict, *, force: bool) -> None:
    expect = case["expect"]
    body = _body(case, port, FORCED_CAP if force or expect.get("forced") else TOKEN_CAP)
    if force:
        body["tool_choice"] = "required"
    r = _post(port, case["path"], body)
    if "status" in expect:      # SmolLM2 declares no FIM tokens
        assert r.status_code == expect["status"], r.text
        assert r.json()["error"]["param"] == expect["param"]
        return
    assert r.status_code == 200, r.text
    obj = expect.get("object", "chat.completion")
    if obj == "llama.cpp":      # llama.cpp server's own shape: {"content", "stop"} objects, no [DONE]
        _check_llamacpp(r, bool(body.get("stream")))
        return
    forced = force or bool(expect.get("forced"))
    if body.get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks, done = _sse(r)
        assert done
        if (body.get("stream_options") or {}).get("include_usage"):
            *chunks, usage = chunks
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
        calls, finish = _stream_shape(chunks, obj + ".chunk" if obj == "chat.completion" else obj)
        assert finish in ("stop", "length", "tool_calls")
        if obj == "chat.completion":
            assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
        _check_calls(calls, finish, body.get("tools") or [], forced)
        return
    answer = r.json()
    assert answer["object"] == obj
    choice = answer["choices"][0]
    msg = choice["message"]
    assert msg["role"] == "assistant" and (msg["content"] is None or isinstance(msg["content"], str))
    calls = {i: {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for i, c in enumerate(msg.get("tool_calls") or [])}
    if calls:
        assert choice["finish_reason"] == "tool_calls"
        assert all(c["id"].startswith("call_") for c in calls.values())
    _check_calls(calls, choice["finish_reason"], body.get("tools") or [], forced)


def _check_llamacpp(r: httpx.Response, stream: bool) -> str:
    """llama.cpp's /completion answer; its text."""
    if not stream:
        obj = r.json()
        assert obj["stop"] is True and obj["tokens_predicted"] >= 1 and obj["timings"]["predicted_n"] >= 1
        return obj["content"]
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks, done = _sse(r)
    assert not done and chunks
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert chunks[-1]["stop_type"] in ("eos", "limit") and chunks[-1]["tokens_predicted"] >= 1
    return "".join(c["content"] for c in chunks)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_editor_request_bodies(single, fixture):
    """Each body as the editor sends it (tests/compat/*.json names the client source it
    was read from), with token limits capped; where the client sends tools, once more
    with tool_choice "required", so that a call is made against the client's own tool
    schemas and its deltas reach the client's parser."""
    node, _ = single
    case = json.loads((COMPAT / fixture).read_text())
    assert case["source"] and all(s["repo"] and s["path"] for s in case["source"])
    port = node.info["http_port"]
    _replay(port, case, force=False)
    if case["expect"].get("tools") and not case["expect"].get("forced"):
        _replay(port, case, force=True)


def test_split_equals_single_node(smollm2, single, tmp_path):
    """Logprobs are computed on the final stage and travel back in TokenReturn; the n
    choices' shared prefill is copied on every stage (SessionCopy): same numbers."""
    _, reference = single
    names = ["s0", "s1"]
    homes = [_home_with_model(tmp_path, n, smollm2.path) for n in names]
    _same_mesh(homes)
    helper = start_node(homes[1], "s1", "--no-model", *NODE_FLAGS)
    coord = None
    try:
        helper.wait_up(30)
        coord = start_node(homes[0], "s0", "--model", str(smollm2.path), "--split", "2", *NODE_FLAGS).wait_up(30)
        _wait_ready(coord)
        assert [s["state"] for s in coord.status()["stages"]] == ["ready", "ready"]
        split = _observations(coord.info["http_port"], smollm2.path)
        assert split == reference
    finally:
        for n in (coord, helper):
            if n is not None:
                n.stop()
