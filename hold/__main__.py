from hold.entry import main

raise SystemExit(main())
