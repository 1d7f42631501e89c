"""What a front end needs of the daemon: the request desk.

A socket connection (:mod:`.connection`), one request's delivery (:mod:`.delivery`) and the
HTTP gateway (:mod:`uma_trio.http.gateway`) open, cancel and stream requests through this
interface, not through
:class:`~.server.Server` itself, so that they do not import the module that imports them
(the server creates the connections).  :class:`~.server.Server` is the one implementation.
"""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from ..config import ServerConfig
from ..observability.metrics import Metrics
from ..protocol.messages import GenerateRequest, ModelsEvent, ModelsRequest, SnapshotEvent, SnapshotRequest
from .clients import Clients
from .decode_loop import DecodeLoop
from .models import ModelHost
from .stream import RequestStream


class RequestDesk(Protocol):
    config: ServerConfig
    loop: DecodeLoop  # the primary model's
    clients: Clients  # the connections open on every front end (runtime/clients.py)
    models: ModelHost  # every model of the store (runtime/models.py)
    metrics: Metrics
    open_deliveries: int  # requests whose client has not yet been handed its last event
    registry: CollectorRegistry  # the Prometheus exposition (GET /metrics)

    def metrics_snapshot(self) -> dict[str, Any]: ...

    def describe_engine(self) -> dict[str, Any]: ...

    def next_connection_number(self) -> int: ...

    async def open_request(
        self,
        request: GenerateRequest,
        arrived: float,
        *,
        connection: int,
        owner: str = "",
        auto_max_tokens: bool = False,
        pin_on_finish: bool = False,
    ) -> RequestStream: ...

    async def snapshot(self, request: SnapshotRequest, connection: int, owner: str = "") -> SnapshotEvent: ...

    async def models_op(self, request: ModelsRequest) -> ModelsEvent: ...

    async def count_tokens(self, request: GenerateRequest) -> int: ...
