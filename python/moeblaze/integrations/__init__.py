"""Adapters that plug moeblaze into other frameworks (moeblaze.integrations.hf: Hugging Face
transformers). Each imports its framework only when used."""
