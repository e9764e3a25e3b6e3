"""The built-in HF engine (:mod:`.hf_engine`, imports transformers), and what every engine shares:
:mod:`.async_engine` (batching concurrent asyncio requests) and :mod:`.sampling` (sampling, request checks).
"""
