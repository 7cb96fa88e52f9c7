"""chatserve: an LLM chat server (docs/architecture.md has the map)."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version
    try:
        return package_version("chatserve")
    except PackageNotFoundError:
        return "unknown"
