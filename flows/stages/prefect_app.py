"""The app of the temporary Prefect server that a `dlrm` command starts for itself
(flows/stages/local_server.py): Prefect's own, running one service more than Prefect runs
in a temporary server.

A trainer slot is a concurrency lease that its holder renews (flows/stages/trainer_slots.py).
The service that revokes a lease nobody renews, Prefect's repossessor, runs only in
long-lived servers. Without it, a `dlrm run` killed while it trained (SIGKILL, a lost
terminal) would leave its slot counted in the Prefect home's database, and every later
command on that home would wait for it for ever. With it, the next command's server gives
the slot back once the dead holder's lease expires.
"""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI
from prefect.server.api.server import create_app as create_prefect_app
from prefect.server.services import perpetual_services
from prefect.server.services.repossessor import monitor_expired_leases


def create_app() -> FastAPI:
    """uvicorn's factory: Prefect's app, with the repossessor among its temporary-server services."""
    services = perpetual_services._PERPETUAL_SERVICES
    for index, service in enumerate(services):
        if service.function is monitor_expired_leases:
            services[index] = dataclasses.replace(service, run_in_ephemeral=True)
    return create_prefect_app()
