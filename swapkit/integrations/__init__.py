"""Integrations at the edge of swapkit: the core never imports them (or transformers).

``models`` builds a model for ``swapkit plan --model`` on the meta device; ``transformers`` holds
the Hugging Face ``Trainer`` callback (it needs ``pip install transformers accelerate``).
"""
