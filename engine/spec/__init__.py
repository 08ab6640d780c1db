"""Speculative decoding without a draft model: n-gram drafts from a request's own tokens, verified
by the target model in one ragged extend step (``docs/design/speculative.md``)."""
