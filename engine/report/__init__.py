"""What leaves the engine for people: HTML reports, the Story, sweep reports and views, the shared
charts, the advisor and the definitions of every figure."""
