"""How closely a configuration of the engine tracks a reference: teacher-forced logit comparisons."""
