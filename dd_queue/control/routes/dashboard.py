"""``GET /``: the dashboard (one static page, live through ``/api/events``), its assets under
``/static``, and Plotly served from the installed ``plotly`` package (no CDN, no copy)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse

router = APIRouter(tags=["dashboard"])

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'"
)


@router.get(
    "/",
    summary="The live dashboard",
    response_class=FileResponse,
    responses={200: {"content": {"text/html": {}}, "description": "The page."}},
)
def dashboard() -> FileResponse:
    """The dashboard page (it loads ``/static/dashboard.js`` and ``/vendor/plotly.min.js``)."""
    headers = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"}
    return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html", headers=headers)


@router.get(
    "/vendor/plotly.min.js",
    summary="Plotly, from the installed plotly package",
    response_class=FileResponse,
    responses={
        200: {"content": {"text/javascript": {}}, "description": "plotly.min.js"},
        404: {"description": "plotly is not installed."},
    },
)
def plotly_js() -> FileResponse:
    """The bundled ``plotly.min.js`` of the ``plotly`` Python package."""
    try:
        path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    except ModuleNotFoundError:
        path = Path("/nonexistent")
    if not path.is_file():
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, "plotly is not installed (pip install plotly)"
        )
    headers = {"Cache-Control": "public, max-age=86400"}
    return FileResponse(path, media_type="text/javascript", headers=headers)
