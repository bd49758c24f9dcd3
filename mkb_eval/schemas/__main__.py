"""``python -m mkb_eval.schemas``: regenerate every exported JSON Schema from its model."""

import sys

from mkb_eval.schemas import schema_files, write_all

written = write_all()
print(f"{len(written)} of {len(schema_files())} schema(s) rewritten: "
      + (", ".join(p.name for p in written) or "all current"), file=sys.stderr)
