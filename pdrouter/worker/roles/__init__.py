"""Worker roles: what a prefill, decode or colocated worker serves on top of the common process."""

from __future__ import annotations

from pdrouter.core.workers import WorkerRole
from pdrouter.worker.role import Role, RoleContext, RoleFactory
from pdrouter.worker.roles.colocated import build_colocated_role
from pdrouter.worker.roles.decode import build_decode_role
from pdrouter.worker.roles.prefill import build_prefill_role

_BUILDERS: dict[WorkerRole, RoleFactory] = {
    WorkerRole.PREFILL: build_prefill_role, WorkerRole.DECODE: build_decode_role,
    WorkerRole.COLOCATED: build_colocated_role}


async def build_role(ctx: RoleContext) -> Role:
    """The role ``ctx.config.role`` names, built on the started process ``ctx`` describes."""
    return await _BUILDERS[ctx.config.role](ctx)
