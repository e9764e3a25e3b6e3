"""Rollout engines built into rlhf-core, and what every engine shares.

- :mod:`rlhf_core.rollout.hf_engine`: ``HFEngine``, the transformers engine (imports transformers).
- :mod:`rlhf_core.rollout.async_engine`: ``AsyncEngine``, batching concurrent asyncio requests.
- :mod:`rlhf_core.rollout.sampling`: counter-based sampling math and request checks.
"""
