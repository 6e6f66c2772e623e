"""Prefill/decode disaggregation in llm-d's contract (vLLM's NixlConnector): a prefill pod
computes a prompt and lends its KV blocks; a decode pod reads them over NIXL and decodes
without computing the prompt again."""
