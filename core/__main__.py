from rankscope.cli.main import main

raise SystemExit(main())
