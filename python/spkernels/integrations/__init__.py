"""Entry points shaped like other engines' kernel interfaces (``spkernels.integrations.vllm``)."""
