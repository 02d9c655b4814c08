"""The package version (one place), and the build facts DeepSpeed's top level also carries."""

__version__ = "0.1.0"
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split(".")[:3])
__git_hash__ = "unknown"  # a released package, not a git checkout
__git_branch__ = "unknown"
