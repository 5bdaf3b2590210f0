"""Speculative decoding on stage 0 (pure logic: no I/O, no asyncio), plus the draft models.

- ``ngram``      prompt-lookup proposer (incremental n-gram index)
- ``policy``     auto policy (COLD / ENABLED / COOLING_DOWN / OFF): when to draft
- ``window``     window policies and controllers: how many drafts per verify
- ``cost_model`` seconds per step by window on this route; what a window yields
- ``acceptance`` sampling and the acceptance rule (runs on the final stage)
- ``stats``      telemetry counters, ``SpecStats`` snapshots, llama.cpp-style ``timings``
- ``strategy``   the ``Proposer`` seam and ``resolve_strategy`` (CLI > config > package > built-in)
- ``draft``      a draft model as a proposer (uses the engine: llama.cpp)
- ``derive``     drafts derived from the target: requantized, or its first N layers
- ``lookahead``  the lookahead window sent behind a verify

See docs/speculative.md.
"""
