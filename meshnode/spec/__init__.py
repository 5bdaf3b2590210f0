"""Speculative decoding on stage 0 (pure logic: no I/O, no asyncio, no llama_cpp).

- ``ngram``      prompt-lookup proposer (incremental n-gram index)
- ``policy``     auto policy (COLD / ENABLED / COOLING_DOWN / OFF): when to draft
- ``window``     window policies and controllers: how many drafts per verify
- ``cost_model`` seconds per step by window on this route; what a window yields
- ``acceptance`` sampling and the acceptance rule (runs on the final stage)
- ``stats``      telemetry counters, ``SpecStats`` snapshots, llama.cpp-style ``timings``
- ``strategy``   the ``Proposer`` seam and ``resolve_strategy`` (CLI > config > package > built-in)

See docs/speculative.md.
"""
