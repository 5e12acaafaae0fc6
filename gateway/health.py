"""What the gateway can do right now, as its health answers say it: one snapshot, two fronts.

A gateway has two capabilities that fail independently:
- **generate**: some worker group passes its health checks. Unguided requests, and guided
  ones whose grammar the gateway already compiled (gateway/grammar_refs.py), need only this.
- **compile**: the grammar service answers its own health check, so new grammars compile.

Both are off while the gateway drains. The gRPC health service reports each capability under
its own service name (`GENERATE`, `COMPILE`, SERVING / NOT_SERVING) beside the overall "" and
the Gateway service, which follow `generate`; HTTP `GET /ready` returns `Readiness.as_dict()`.
Plain Python: no grpc, no asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass

# Health-check service names of the capabilities, in the protos' package (gramserve.v1).
GENERATE = "gramserve.v1.generate"
COMPILE = "gramserve.v1.compile"
CAPABILITIES = {"generate": GENERATE, "compile": COMPILE}


@dataclass(frozen=True)
class Readiness:
    """One snapshot of the gateway's health inputs, and what follows from them."""

    draining: bool
    healthy_groups: int
    groups: int
    grammar_service_up: bool
    cached_grammars: int  # compiled-grammar keys remembered (servable without the service)

    @property
    def generate(self) -> bool:
        """Requests can run: not draining and at least one worker group healthy."""
        return not self.draining and self.healthy_groups > 0

    @property
    def compile(self) -> bool:
        """New grammars can compile: not draining and the grammar service answers."""
        return not self.draining and self.grammar_service_up

    @property
    def status(self) -> str:
        """"ready" (everything works), "degraded" (generation works, new grammars do not:
        cached grammars and unguided requests still serve) or "unavailable"."""
        if not self.generate:
            return "unavailable"
        return "ready" if self.compile else "degraded"

    def serving(self) -> dict[str, bool]:
        """Health-check service name -> SERVING, for each capability."""
        return {GENERATE: self.generate, COMPILE: self.compile}

    def as_dict(self) -> dict:
        """The JSON body of `GET /ready`."""
        return {"status": self.status, "generate": self.generate, "compile": self.compile,
                "draining": self.draining, "healthy_groups": self.healthy_groups,
                "groups": self.groups,
                "grammar_service": "serving" if self.grammar_service_up else "unavailable",
                "cached_grammars": self.cached_grammars}
