"""Patches to third-party code, each pinned to the exact upstream version it was written for (see README.md).

Nothing is patched on import of this package: import a module and call its entry point (for example
`patches.speculators_cpu.apply()`), or name it where the upstream library loads plugins by module path.
"""
