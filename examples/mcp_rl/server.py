"""A small MCP server of ours: unit conversion (length, mass, temperature) and a unit catalog.

Four tools and one resource, stateless, so rollouts running at the same time can share one
connection. Run over stdio (what ``train.py`` does: the MCP client starts it as a subprocess) or
over streamable HTTP:

    python examples/mcp_rl/server.py                                   # stdio
    python examples/mcp_rl/server.py --transport streamable-http --port 8765   # http://127.0.0.1:8765/mcp

Works with the ``mcp`` package's v1 (``FastMCP``) and v2 (``MCPServer``) APIs.
"""

from __future__ import annotations

import argparse
import json

try:  # mcp 2.x renamed FastMCP to MCPServer
    from mcp.server.mcpserver import MCPServer as _Server
    from mcp.server.mcpserver.exceptions import ToolError

    MCP_V2 = True
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as _Server
    from mcp.server.fastmcp.exceptions import ToolError

    MCP_V2 = False

#: Factors to the base unit of each kind (metre, kilogram).
LENGTH = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048, "mi": 1609.344}
MASS = {"g": 0.001, "kg": 1.0, "lb": 0.45359237, "oz": 0.028349523125}
TEMPERATURE = ("C", "F", "K")
KINDS = {"length": sorted(LENGTH), "mass": sorted(MASS), "temperature": list(TEMPERATURE)}


def _factor_convert(table: dict[str, float], value: float, from_unit: str, to_unit: str) -> float:
    for unit in (from_unit, to_unit):
        if unit not in table:
            raise ToolError(f"unknown unit {unit!r}; known: {', '.join(sorted(table))}")
    return round(value * table[from_unit] / table[to_unit], 6)


def to_kelvin(value: float, unit: str) -> float:
    if unit == "C":
        return value + 273.15
    if unit == "F":
        return (value - 32) * 5 / 9 + 273.15
    if unit == "K":
        return value
    raise ToolError(f"unknown unit {unit!r}; known: C, F, K")


def from_kelvin(value: float, unit: str) -> float:
    if unit == "C":
        return value - 273.15
    if unit == "F":
        return (value - 273.15) * 9 / 5 + 32
    if unit == "K":
        return value
    raise ToolError(f"unknown unit {unit!r}; known: C, F, K")


def build_server() -> _Server:
    server = _Server("unit-converter", log_level="WARNING")

    @server.tool()
    def convert_length(value: float, from_unit: str, to_unit: str) -> str:
        """Convert a length between mm, cm, m, km, in, ft and mi."""
        return json.dumps({"value": _factor_convert(LENGTH, value, from_unit, to_unit), "unit": to_unit})

    @server.tool()
    def convert_mass(value: float, from_unit: str, to_unit: str) -> str:
        """Convert a mass between g, kg, lb and oz."""
        return json.dumps({"value": _factor_convert(MASS, value, from_unit, to_unit), "unit": to_unit})

    @server.tool()
    def convert_temperature(value: float, from_unit: str, to_unit: str) -> str:
        """Convert a temperature between C (Celsius), F (Fahrenheit) and K (Kelvin)."""
        result = round(from_kelvin(to_kelvin(value, from_unit), to_unit), 6)
        return json.dumps({"value": result, "unit": to_unit})

    @server.tool()
    def list_units(kind: str) -> str:
        """List the units of one kind: length, mass or temperature."""
        if kind not in KINDS:
            raise ToolError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
        return json.dumps(KINDS[kind])

    @server.resource("units://catalog", name="catalog", description="Every supported unit, by kind")
    def catalog() -> str:
        return json.dumps(KINDS)

    return server


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--transport", choices=["stdio", "streamable-http"], default="stdio")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args(argv)
    server = build_server()
    if args.transport == "stdio":
        server.run("stdio")
    elif MCP_V2:
        server.run("streamable-http", host=args.host, port=args.port)
    else:
        server.settings.host, server.settings.port = args.host, args.port
        server.run("streamable-http")


if __name__ == "__main__":
    main()
