"""OpenAI's predicted output (``prediction``): drafts from the text the client expects back.

The serving loop with the oracle pipeline of tests/test_lookahead_serving.py (a fake model
that continues one true text and verifies windows as the final stage does); the prompt
here does not hold the answer, so only the prediction can draft it. The HTTP shape is
checked through the real endpoint in tests/test_openai_units.py's way (parse_request).
"""

from __future__ import annotations

import asyncio

import pytest

from meshnode.serve.client import ChatMessage, GenerationRequest
from meshnode.serve.errors import UnsupportedValueError
from meshnode.serve.model_server import ModelServer, ServeSettings
from meshnode.serve.request import prediction_usage
from meshnode.serve.schemas import ChatCompletionRequest, parse_request
from char_tokenizer import CharTokenizer
from inproc import answer
from test_lookahead_serving import OraclePipeline, _spec

ASK = "Rename the function in the file I sent earlier."
ANSWER = "def sum_all(items):\n    s = 0\n    for x in items:\n        s += x.price\n    return s\n"


def _run(prediction: str | None, mode: str = "auto", temperature: float = 0.0, n: int = 1):
    tok = CharTokenizer()
    req = GenerationRequest("r", "m", messages=(ChatMessage("user", ASK),), max_tokens=len(ANSWER),
                            temperature=temperature, seed=3, prediction=prediction, n=n)

    async def main():
        prompt = tok.apply_chat_template([{"role": "user", "content": ASK}])[0]
        pipe = OraclePipeline(prompt + tok.encode(ANSWER, add_bos=False))
        pipe.n_stages = 1
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=max(n, 1), spec=_spec(mode)), tok, pipe)
        text, fin = await answer(server, req)
        await server.scheduler.close()
        return text, fin, pipe

    return asyncio.run(main())


def test_a_predicted_output_drafts_the_answer_and_changes_nothing_in_it():
    plain, plain_fin, plain_pipe = _run(None)
    assert plain == ANSWER     # (its own repeats draft a little: the indentation)
    text, fin, pipe = _run(ANSWER.replace("sum_all", "total"))       # the file as it was
    assert text == ANSWER
    accepted, plain_accepted = fin.timings.draft_n_accepted, plain_fin.timings.draft_n_accepted
    assert accepted >= 3 * max(plain_accepted, 5), (accepted, plain_accepted)
    assert len(pipe.steps) < 0.5 * len(plain_pipe.steps), (len(pipe.steps), len(plain_pipe.steps))
    # usage counts the prediction's tokens the answer repeats: all but the renamed ones
    renamed = ANSWER.replace("sum_all", "total")
    assert fin.usage.accepted_prediction_tokens + fin.usage.rejected_prediction_tokens == len(renamed)
    assert len(renamed) - 8 <= fin.usage.accepted_prediction_tokens < len(renamed), fin.usage
    assert plain_fin.usage.accepted_prediction_tokens is None    # no prediction, no count
    # a wrong prediction costs rejected drafts, never a different answer
    wrong = "print('something else entirely')\n" * 3
    text, fin, _ = _run(wrong)
    assert text == ANSWER
    assert fin.usage.rejected_prediction_tokens > 0.7 * len(wrong), fin.usage


def test_prediction_usage_counts_the_repeated_tokens_in_order():
    assert prediction_usage([], [1, 2]) == (0, 0)
    assert prediction_usage([1, 2, 3, 4], [1, 2, 3, 4]) == (4, 0)
    assert prediction_usage([1, 2, 3, 4], [1, 9, 3, 4, 5]) == (3, 1)
    assert prediction_usage([1, 2, 3], []) == (0, 3)
    # order matters: a reversed answer repeats one token of the prediction in order
    assert prediction_usage([1, 2, 3], [3, 2, 1]) == (1, 2)


def test_the_prediction_is_read_from_text_parts_and_anything_else_is_refused():
    body = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
            b'"prediction": {"type": "content", "content": [{"type": "text", "text": "a"}, '
            b'{"type": "text", "text": "b"}]}}')
    req = parse_request(ChatCompletionRequest, body).to_generation_request("r")
    assert req.prediction == "a\nb"
    assert parse_request(ChatCompletionRequest, body.replace(b'"prediction"', b'"other"')
                         ).to_generation_request("r").prediction is None
    bad = body.replace(b'{"type": "text", "text": "b"}', b'{"type": "image_url"}')
    with pytest.raises(UnsupportedValueError) as exc:
        parse_request(ChatCompletionRequest, bad).to_generation_request("r")
    assert "prediction.content[1].type" in str(exc.value.param)


def test_the_choices_of_one_request_share_the_predictions_automaton(monkeypatch):
    import meshnode.serve.speculation as speculation

    built = []

    def counted(tokens):
        built.append(len(tokens))
        return real(tokens)

    real = speculation.SuffixAutomaton
    monkeypatch.setattr(speculation, "SuffixAutomaton", counted)
    text, fin, _ = _run(ANSWER, n=3)
    assert sorted(text) == sorted(ANSWER * 3)    # three greedy choices (interleaved), each the answer
    assert built == [len(ANSWER)], built
    assert fin.usage.accepted_prediction_tokens == len(ANSWER)   # a choice's own count
