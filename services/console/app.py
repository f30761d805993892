"""The console's HTTP app: server-rendered pages (Jinja2), fragments that htmx swaps in, a JSON
API the charts read, and ``/events``, a Server-Sent Events stream fed by NATS subscriptions.

Read-only: nothing here writes to PostgreSQL, and nothing publishes to NATS as the console. The
two actions (``POST /actions/...``: re-publish a dead letter, resume a replica) act with the NATS
admin credential of whoever asks (``actions``).

``/healthz`` is 200 while the process runs; ``/readyz`` is 200 once the console has logged
``ready`` (``shared.health``) while NATS and PostgreSQL answer, 503 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Annotated
from urllib.parse import urlsplit

import asyncpg
import nats
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from artery.services.console import actions, live, queries
from artery.services.console.settings import ConsoleSettings
from artery.services.console.tokens import shaded_tokens
from artery.shared.health import HEALTH
from artery.shared.settings import CommonSettings

_HERE = resources.files("artery.services.console")


@dataclass
class Sources:
    """Where the console reads from; set once connected (tests may give their own)."""

    pool: asyncpg.Pool
    nc: nats.NATS
    settings: ConsoleSettings
    #: Where the actions connect (with the asker's credential).
    common: CommonSettings


def _optional(value: str | None, cast):
    """Empty form fields are absent filters; a bad number is the client's error (422)."""
    if value is None or value.strip() == "":
        return None
    try:
        return cast(value)
    except ValueError:
        raise HTTPException(422, f"not a number: {value!r}") from None


def _shade(prob: float | None) -> str:
    """Background of a token: white when the policy was sure, red as its probability falls."""
    if prob is None:
        return "transparent"
    return f"rgba(220, 38, 38, {min(max(1.0 - prob, 0.0), 1.0) * 0.75:.2f})"


def refuse_cross_site(request: Request) -> None:
    """403 for an action posted from another site's page. Browsers resend cached HTTP Basic
    credentials with a cross-site form post, so without this a page an operator visits could
    resume a paused replica mid-step. A browser names the page's origin (``Origin``, or
    ``Sec-Fetch-Site``); an API client (curl, httpx) sends neither and is let through."""
    host = request.headers.get("host", "")
    origin = request.headers.get("origin")
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise HTTPException(403, "cross-site request refused")
    if origin is not None and urlsplit(origin).netloc != host:
        raise HTTPException(403, f"cross-site request from {origin[:100]!r} refused")


def create_app(sources: Sources) -> FastAPI:
    app = FastAPI(title="Artery console", docs_url=None, redoc_url=None, openapi_url=None)
    templates = Jinja2Templates(directory=str(_HERE / "templates"))
    templates.env.filters["shade"] = _shade
    templates.env.filters["fmt"] = lambda v, n=3: (
        "–" if v is None else (f"{v:.{n}f}" if isinstance(v, float) else v)
    )
    app.mount("/static", StaticFiles(directory=str(_HERE / "static")), name="static")

    def page(request: Request, name: str, **context) -> HTMLResponse:
        return templates.TemplateResponse(request, name, context)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        _, body = HEALTH.status()
        ok = body["ready"] and sources.nc.is_connected
        try:
            async with sources.pool.acquire() as conn:
                await conn.fetchval("SELECT 1")
        except Exception:
            ok = False
        return JSONResponse({**body, "ready": ok}, status_code=200 if ok else 503)

    admin = sources.settings.admin_user

    def acted(request: Request, result: dict, back: str) -> Response:
        # A form in the browser goes back to its page; an API client gets what was done.
        if "text/html" in request.headers.get("accept", ""):
            return Response(status_code=303, headers={"Location": back})
        return JSONResponse(result)

    @app.post("/actions/dead-letters/{seq}/republish")
    async def republish(request: Request, seq: int) -> Response:
        refuse_cross_site(request)
        async with actions.AdminSession(sources.nc, sources.common, actions.credential(request), admin) as s:
            return acted(request, await actions.republish(s, seq), "/dead-letters")

    @app.post("/actions/replicas/{project}/{model}/{replica_id}/resume")
    async def resume(request: Request, project: str, model: str, replica_id: str) -> Response:
        refuse_cross_site(request)
        async with actions.AdminSession(sources.nc, sources.common, actions.credential(request), admin) as s:
            return acted(request, await actions.resume(s, project, model, replica_id), "/replicas")

    @app.get("/", response_class=HTMLResponse)
    async def index(request: Request):
        async with sources.pool.acquire() as conn:
            rows = await queries.models(conn)
        records = await live.model_records(sources.nc.jetstream())
        seen = {(r["project"], r["name"]) for r in rows}
        for (project, name), record in records.items():  # registered, nothing stored yet
            if (project, name) not in seen:
                rows.append(
                    {
                        "project": project,
                        "name": name,
                        "base_model": record.base_model,
                        "last_step": None,
                        "groups": 0,
                    }
                )
        for row in rows:
            registered = records.get((row["project"], row["name"]))
            row["registry_step"] = registered.step if registered else None
            row["base_model"] = row["base_model"] or (registered.base_model if registered else None)
        projects: dict[str, list[dict]] = {}
        for row in sorted(rows, key=lambda r: (r["project"], r["name"])):
            projects.setdefault(row["project"], []).append(row)
        return page(request, "index.html", projects=projects)

    @app.get("/models/{project}/{model}", response_class=HTMLResponse)
    async def model_page(request: Request, project: str, model: str):
        return page(request, "model.html", project=project, model=model)

    @app.get("/api/models/{project}/{model}/curve")
    async def curve(project: str, model: str) -> dict:
        async with sources.pool.acquire() as conn:
            return {
                "steps": await queries.steps(conn, project, model),
                "val": await queries.val_curve(conn, project, model),
                "judge": await queries.judge_cost(conn, project, model),
            }

    @app.get("/models/{project}/{model}/trajectories", response_class=HTMLResponse)
    async def trajectory_list(
        request: Request,
        project: str,
        model: str,
        step: Annotated[str | None, Query()] = None,
        min_reward: Annotated[str | None, Query()] = None,
        max_reward: Annotated[str | None, Query()] = None,
        group: Annotated[str | None, Query()] = None,
    ):
        async with sources.pool.acquire() as conn:
            rows = await queries.trajectories(
                conn,
                project,
                model,
                step=_optional(step, int),
                min_reward=_optional(min_reward, float),
                max_reward=_optional(max_reward, float),
                group_id=group or None,
                limit=sources.settings.page_size,
            )
        return page(request, "_trajectories.html", project=project, model=model, rows=rows)

    @app.get("/models/{project}/{model}/trajectories/{group_id}/{idx}", response_class=HTMLResponse)
    async def trajectory_page(request: Request, project: str, model: str, group_id: str, idx: int):
        async with sources.pool.acquire() as conn:
            row = await queries.trajectory(conn, project, model, group_id, idx)
            base_model = await conn.fetchval(
                "SELECT base_model FROM models WHERE project = $1 AND name = $2", project, model
            )
        if row is None:
            raise HTTPException(404, f"no trajectory {group_id}/{idx} of {project}/{model}")
        if base_model is None:
            record = (await live.model_records(sources.nc.jetstream())).get((project, model))
            base_model = record.base_model if record else None
        body = row["body"]
        histories = [body.get("messages") or []] + [
            h.get("messages") or [] for h in body.get("additional_histories") or []
        ]
        rendered = [
            [
                {**m, "tokens": shaded_tokens(m["sample"], base_model) if m.get("sample") else None}
                for m in messages
            ]
            for messages in histories
        ]
        return page(
            request, "trajectory.html", project=project, model=model, row=row, body=body, histories=rendered
        )

    @app.get("/dead-letters", response_class=HTMLResponse)
    async def dead_letters(request: Request):
        letters = await live.dead_letters(sources.nc.jetstream(), sources.settings.dead_letters)
        return page(request, "dead_letters.html", letters=letters)

    @app.get("/replicas", response_class=HTMLResponse)
    async def replicas_page(request: Request):
        return page(request, "replicas.html", replicas=await live.replicas(sources.nc.jetstream()))

    @app.get("/fragments/replicas", response_class=HTMLResponse)
    async def replicas_fragment(request: Request, project: str | None = None, model: str | None = None):
        found = [
            r
            for r in await live.replicas(sources.nc.jetstream())
            if (project is None or r["project"] == project) and (model is None or r["model"] == model)
        ]
        return page(request, "_replicas.html", replicas=found)

    @app.get("/events")
    async def events(project: str | None = None, model: str | None = None) -> StreamingResponse:
        return StreamingResponse(
            live.feed(sources.nc, project, model),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app
