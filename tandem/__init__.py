"""Tandem: disaggregated prefill/decode LLM serving."""
