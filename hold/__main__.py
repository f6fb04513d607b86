from hold.cli.entry import main

raise SystemExit(main())
