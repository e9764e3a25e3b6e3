"""Rollout engines built into rlhf-core (:mod:`.hf_engine`: ``HFEngine``, imports transformers), and what
every engine shares: :mod:`.async_engine` (batching concurrent asyncio requests) and :mod:`.sampling`
(counter-based sampling math, request checks).
"""
