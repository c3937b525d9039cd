from pointerdomain.cli import main

raise SystemExit(main())
