// nested fixture extension
export const fixture = "more";
