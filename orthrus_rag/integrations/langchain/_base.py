"""What every LangChain component shares: where the engine is (in-process or a base URL) and the transport."""

from __future__ import annotations

from typing import Any

from langchain_core.utils import from_env, secret_from_env
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from orthrus_rag.integrations.langchain.transport import LocalOrthrus, RemoteOrthrus, make_transport


class OrthrusConnection(BaseModel):
    """`engine` (an `Engine`, `AsyncEngine` or `LocalOrthrus`: in-process, shared) or `base_url` (a running
    `orthrus-rag serve`, e.g. http://127.0.0.1:8000/v1; default: the ORTHRUS_BASE_URL environment variable)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True, protected_namespaces=())

    engine: Any = Field(default=None, exclude=True)
    """An in-process engine shared by the components built on it."""
    base_url: str | None = Field(default_factory=from_env("ORTHRUS_BASE_URL", default=None))
    """The server's OpenAI base URL (ending in /v1)."""
    api_key: SecretStr | None = Field(default_factory=secret_from_env("ORTHRUS_API_KEY", default=None))
    """The server's API key, if it has one (default: the ORTHRUS_API_KEY environment variable)."""
    timeout: float | None = None
    """Seconds an HTTP request may take."""
    max_retries: int = 2
    """Retries of a failed HTTP request (the openai client's)."""

    _transport: LocalOrthrus | RemoteOrthrus | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_place(self) -> "OrthrusConnection":
        if self.engine is not None and self.base_url is not None:
            raise ValueError("give engine= (in-process) or base_url= (a server), not both")
        return self

    @property
    def transport(self) -> LocalOrthrus | RemoteOrthrus:
        """Made on first use, so constructing a component is cheap and needs no server."""
        if self._transport is None:
            if self.engine is None and self.base_url is None:
                raise ValueError("no engine: pass engine= (in-process) or base_url= (or set ORTHRUS_BASE_URL)")
            key = self.api_key.get_secret_value() if self.api_key is not None else None
            self._transport = make_transport(self.engine, self.base_url, key, self.timeout, self.max_retries)
        return self._transport
