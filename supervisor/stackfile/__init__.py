"""The stack file: YAML read strictly into a frozen spec, every refusal with file:line.

Owns the schema (``schema``: one table of keys per mapping, walked by one
reader that gives the spec or words every refusal; no pydantic), the values
and the cross-unit checks, ``env_file`` and placeholders. Knows nothing of
running processes: may import only the top-level modules of
``hold_supervisor`` (yamlsafe, parse, errors).
"""
