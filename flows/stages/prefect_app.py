"""The app of the temporary Prefect server that a `dlrm` command starts for itself
(flows/stages/local_server.py): Prefect's own, running one service more than Prefect runs
in a temporary server, on a new home's database copied from the template
(flows/stages/prefect_database.py).

A trainer slot is a concurrency lease that its holder renews (flows/stages/trainer_slots.py).
The service that revokes a lease nobody renews, Prefect's repossessor, runs only in
long-lived servers. Without it, a `dlrm run` killed while it trained (SIGKILL, a lost
terminal) would leave its slot counted in the Prefect home's database, and every later
command on that home would wait for it for ever. With it, the next command's server gives
the slot back once the dead holder's lease expires.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from training.launch.interpreter import imports_without_collection

if TYPE_CHECKING:
    from fastapi import FastAPI


def create_app() -> FastAPI:
    """uvicorn's factory: Prefect's app, with the repossessor among its temporary-server services."""
    # Prefect's server imported and built here, with the collector paused: 1.1 s of the
    # server's 3.8 s start (training/launch/interpreter.py; uvicorn imports this module first)
    with imports_without_collection():
        from prefect.server.api.server import create_app as create_prefect_app
        from prefect.server.services import perpetual_services
        from prefect.server.services.repossessor import monitor_expired_leases

        from flows.stages.prefect_database import copy_template_to, keep_as_template, new_database

        new = new_database()
        from_nothing = new if new is not None and not copy_template_to(new) else None
        services = perpetual_services._PERPETUAL_SERVICES
        for index, service in enumerate(services):
            if service.function is monitor_expired_leases:
                services[index] = dataclasses.replace(service, run_in_ephemeral=True)
        app = create_prefect_app()
        if from_nothing is not None:
            _keep_the_new_database(app, from_nothing, keep_as_template)
        return app


def _keep_the_new_database(app: FastAPI, path: Path, keep_as_template: Callable[[Path], None]) -> None:
    """The template kept once Prefect's start-up (migrations, block types) has made `path`:
    uvicorn answers no request before the start-up ends."""
    start_up = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(served: FastAPI) -> AsyncIterator[None]:
        async with start_up(served) as state:
            keep_as_template(path)
            yield state

    app.router.lifespan_context = lifespan
