from pointerdomain.tools.cli import main

raise SystemExit(main())
