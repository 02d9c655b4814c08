"""Modules that exist only so that a DeepSpeed import path resolves (`deepspeed.runtime.config`,
`deepspeed.utils.groups`, `deepspeed.ops.op_builder`, ...).

Each is reached through the path table (shardspeed/compat/paths.py), never imported by the library itself;
a DeepSpeed path whose names live in a real shardspeed module is a table entry, not a module here.
"""
