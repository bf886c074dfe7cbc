"""``python -m hetroute`` runs the CLI."""

from hetroute.cli import main

raise SystemExit(main())
