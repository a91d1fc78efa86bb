"""Deciding what stays on the device: memory estimate, cost model, solvers, planners.

- ``training_plan``: ``TrainingPlan``, one graph's decisions and what building them gave.
- ``memory_estimate``: the liveness walk that gives a rewritten program's peak device bytes.
- ``cost_model``: FLOPs and bytes per op, the three-lane time simulation, the roofline.
- ``hardware``: hardware profiles (built in, or measured by ``calibrate``).
- ``solvers``: multiple-choice knapsack solvers, exact and greedy.
- ``flat_planner``: candidates built over the whole graph, priced, the ladder, the choice.
- ``template_planner``: repeated layers planned on two short copies, extrapolated to N.
- ``gradient_reduction``: data parallel: average gradients on the device or on the host.
- ``depth_extrapolation``: a short program's numbers carried to N layers, linearly
  (the template planner's and ``megacompile plan``'s).
"""
