"""The ways in: the `orthrus-rag` CLI (cli.py, commands.py, run_session.py) and the OpenAI-compatible server
(openai/). Both build their engine client from the config (`orthrus_rag.config`, which lives below them)."""
