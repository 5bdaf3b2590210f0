"""Drafting from the same client's recent requests, on a real node: an editor sends a
file, then the same file a little changed with the same request. Drafted with the first
answer in the index, the second answer gets more drafts accepted than the same request
from a new client, and the text is the same (verification decides)."""

from __future__ import annotations

import pytest

from meshnode.bench.cluster import link_model
from meshnode.bench.prompt_sets import load
from tests.nodeproc import start_node

pytestmark = [pytest.mark.slow, pytest.mark.net]


def test_an_edit_drafts_from_the_same_clients_previous_answer(smollm2, tmp_path):
    from openai import OpenAI

    steps = [p for p in load("code_edit") if p.sequence == "editor-users"][:2]
    home = tmp_path / "n"
    link_model(home, smollm2.path)
    node = start_node(home, "n", "--no-discovery", "--model", str(smollm2.path), "--threads", "1",
                      "--ctx", "2048", "--batch", "64", "--parallel", "1",
                      "--spec", "ngram", "--spec-mode", "on",
                      # a window of 4 always: the drafts depend on the texts only, not on timing
                      "--draft-initial", "4", "--draft-min", "4", "--draft-max", "4").wait_up(30).wait_model(180)
    try:
        def ask(key: str, prompt) -> tuple[str, dict]:
            client = OpenAI(base_url=f"http://127.0.0.1:{node.http_port}/v1", api_key=key, max_retries=0)
            r = client.chat.completions.create(model=client.models.list().data[0].id,
                                               messages=prompt.chat(), max_tokens=160, temperature=0)
            return r.choices[0].message.content, r.model_extra["timings"]

        ask("editor", steps[0])
        warm_text, warm = ask("editor", steps[1])       # the first answer is indexed
        cold_text, cold = ask("someone-else", steps[1])  # nothing of this client's yet
    finally:
        node.stop()
    assert warm_text == cold_text
    print(f"\naccepted drafts: {warm['draft_n_accepted']}/{warm['draft_n']} with the previous answer, "
          f"{cold['draft_n_accepted']}/{cold['draft_n']} without")
    assert warm["draft_n_accepted"] > cold["draft_n_accepted"]
