"""Integrations with other frameworks (LangChain)."""
