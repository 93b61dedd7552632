"""Llama-family decoder, HuggingFace loader, tokenizer and the tiny-model generator."""

from tandem.model.config import ModelConfig
from tandem.model.detokenize import IncrementalDetokenizer
from tandem.model.llama import LlamaModel
from tandem.model.loader import load_model
from tandem.model.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "LlamaModel", "ModelConfig", "Tokenizer", "load_model"]
