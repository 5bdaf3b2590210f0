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
    assert prediction_usage([1, 2, 3], []) == (0, 3)
    assert prediction_usage([1, 2], [5, 1, 2, 6]) == (2, 0)          # shorter than a run
    # an edit: 3 replaced by 7, 8 and 9 inserted, the rest kept in order
    assert prediction_usage([1, 2, 3, 4, 5, 6, 10, 11, 12], [1, 2, 7, 8, 4, 5, 6, 9, 10, 11, 12],
                            min_run=2) == (8, 1)
    # in order: a run taken once, and never one behind the last taken
    assert prediction_usage([1, 2, 3, 4, 5, 6], [4, 5, 6, 1, 2, 3, 4, 5, 6]) == (3, 3)
    assert prediction_usage([1, 2, 3], [1, 2, 3, 1, 2, 3]) == (3, 0)


def test_prediction_usage_stays_fast_on_repetitive_texts():
    # difflib took 220 s on this pair (16,000 tokens of a repeated list, every other one
    # changed; it counted 8000 single tokens kept): a model can be led to write such a
    # completion, and the count runs on the thread every request tokenizes on
    prediction = list(range(160)) * 100
    completion = [x if i % 2 == 0 else 10**6 + i for i, x in enumerate(prediction)]
    accepted, rejected = prediction_usage(prediction, completion)
    assert (accepted, rejected) == (0, len(prediction))       # no run of 3 survives
    assert prediction_usage(prediction, prediction) == (len(prediction), 0)


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
