"""`python -m mmspec ...`: the `mmspec` command."""

from mmspec.cli import main

raise SystemExit(main())
