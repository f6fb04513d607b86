"""The stack file: YAML read strictly into a frozen spec, every refusal with file:line.

Owns the schema (the pydantic models for refusals, the plain quick path for a
valid file), the values and the cross-unit checks, ``env_file`` and
placeholders. Knows nothing of running processes: may import only the
top-level modules of ``hold_supervisor`` (yamlsafe, parse, errors).
"""
